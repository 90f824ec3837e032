"""Feature caching, training, checkpoint resume and checkpoint loading, on the tiny random target."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from taps_ray.config import load_config
from taps_ray.data.chat import tokenize_conversation
from taps_ray.data.mixtures import build_mixture
from taps_ray.models.draft_head import DraftHead, load_eagle_checkpoint, new_head
from taps_ray.models.target import load_target
from taps_ray.training import features as features_mod
from taps_ray.report.heads import NOT_MEASURED, NOT_TRAINED, build_heads_report, rerender_heads_md
from taps_ray.training import agreement as agreement_mod
from taps_ray.training.agreement import (
    agreement_file, evaluate_agreement, measure_agreement, trained_heads, unmeasured_heads,
)
from taps_ray.training.answers import greedy_answers
from taps_ray.training.features import Entry, extract_features, features_folder, read_shard
from taps_ray.training.losses import causal_mask
from taps_ray.training.trainer import epoch_batches, heldout_batches, split_examples, train_head
from taps_ray.workdir import features_root, head_dir

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module", autouse=True)
def _env():
    saved_threads = torch.get_num_threads()
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TAPS_DATA_DIR", "HF_HUB_OFFLINE")}
    os.environ["OMP_NUM_THREADS"] = "1"  # tiny tensors: one thread beats two busy-waiting ones
    os.environ.setdefault("TAPS_DATA_DIR", str(REPO.parent / "shared" / "data"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(saved_threads)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    cfg = load_config(TINY).model_copy(update={"work_dir": str(work)})
    cfg.features.shard_size = 8
    target = load_target(cfg.target)
    for name in ("math", "chat"):
        extract_features(cfg, name, target=target, progress=False)
    return cfg, target


def fresh(base, tmp_path, **train_updates):
    """A config with its own work dir that shares the module's extracted features."""
    cfg, target = base
    cfg = cfg.model_copy(deep=True, update={"work_dir": str(tmp_path)})
    for key, value in train_updates.items():
        setattr(cfg.train, key, value)
    tmp_path.mkdir(parents=True, exist_ok=True)
    os.symlink(features_root(base[0]), features_root(cfg))
    return cfg, target


def test_features_content_matches_the_target(base):
    cfg, target = base
    fs = extract_features(cfg, "math", target=target, progress=False)
    assert fs.stats["reused"] and fs.stats["conversations"] > 0
    examples = fs.load()
    convs = {c.id: c for c in build_mixture(cfg.mixtures["math"], cfg.resolved_data_dir())}
    ex = examples[0]
    ids, mask = tokenize_conversation(target.tokenizer, convs[ex.id].messages, cfg.features.max_len)
    assert ex.input_ids.tolist() == ids and ex.loss_mask.tolist() == mask
    with torch.no_grad():
        out = target.model(input_ids=ex.input_ids[None], output_hidden_states=True)
    # stored in half precision: bf16 features (8 significant bits), fp16 probabilities (11)
    assert torch.allclose(ex.hidden.float(), out.hidden_states[-1][0], rtol=2**-8, atol=1e-4)
    probs = torch.softmax(out.logits[0].float(), -1).topk(cfg.features.top_k, -1)
    assert torch.allclose(ex.topk_probs.float(), probs.values, rtol=2**-11, atol=1e-4)
    assert torch.equal(ex.topk_ids[:, 0], probs.indices[:, 0])
    assert ex.hidden.dtype == torch.bfloat16 and ex.topk_probs.dtype == torch.float16
    assert ex.topk_probs.shape[1] == cfg.features.top_k


def test_features_reused_and_killed_run_redoes_only_missing_shards(base, tmp_path, monkeypatch):
    cfg, target = base
    cfg = cfg.model_copy(deep=True, update={"work_dir": str(tmp_path)})
    calls = []
    real = features_mod.target_features
    monkeypatch.setattr(features_mod, "target_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = extract_features(cfg, "chat", target=target, progress=False)
    n_calls = len(calls)
    assert n_calls > 0 and not first.stats["reused"] and first.stats["extracted_shards"] >= 2
    folder = features_folder(cfg, "chat")
    shards = sorted(folder.glob("shard-*.safetensors"))
    mtimes = {p: p.stat().st_mtime_ns for p in shards}

    again = extract_features(cfg, "chat", target=target, progress=False)
    assert again.stats["reused"] and len(calls) == n_calls
    assert again.ids == first.ids

    # a killed run: the manifest was never written and the last shard is missing
    (folder / "manifest.json").unlink()
    shards[-1].unlink()
    redo = extract_features(cfg, "chat", target=target, progress=False)
    assert redo.stats["extracted_shards"] == 1 and not redo.stats["reused"]
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in shards[:-1])
    assert redo.ids == first.ids and redo.stats["tokens"] == first.stats["tokens"]
    assert len(read_shard(shards[-1])) > 0

    other = cfg.model_copy(deep=True)
    other.features.max_len = 80
    assert features_folder(other, "chat") != folder  # the key follows the settings


def test_heldout_rule_is_seeded_and_keeps_both_sides():
    """The one held-out rule: seeded, about `fraction` held out, at least one of each side from two items up."""
    items = [SimpleNamespace(id=f"conv-{i}") for i in range(400)]
    train, held = split_examples(items, 0.05, seed=1)
    assert 8 <= len(held) <= 35 and len(train) + len(held) == 400
    assert split_examples(items, 0.05, seed=1) == (train, held)
    assert split_examples(items, 0.05, seed=2)[1] != held
    assert [len(part) for part in split_examples(items[:3], 0.05, seed=0)] == [2, 1]
    assert [len(part) for part in split_examples(items[:3], 0.99, seed=0)] == [1, 2]


def test_heldout_split_is_per_id_and_consistent_across_mixtures(base):
    cfg, _ = base
    math = extract_features(cfg, "math", progress=False).load()
    train, held = split_examples(math, 0.3, 0)
    assert held and train and len(train) + len(held) == len(math)
    again_train, again_held = split_examples(list(reversed(math)), 0.3, 0)
    assert {e.id for e in again_held} == {e.id for e in held}


def test_train_one_epoch_writes_checkpoint(base, tmp_path):
    cfg, target = fresh(base, tmp_path)
    reports = []
    final = train_head(cfg, "hass", "math", report=reports.append, target=target, progress=False)
    folder = head_dir(cfg, "hass", "math")
    assert final == folder / "final" and (folder / "epoch-1" / "model.safetensors").is_file()
    assert (folder / "epoch-1" / "optimizer.pt").is_file()
    assert len(reports) == 1
    m = reports[0]
    for key in ("epoch", "train_loss", "heldout_loss", "heldout_acc", "tokens_per_s", "checkpoint"):
        assert key in m and m[key] is not None, key
    assert 0.0 <= m["heldout_acc"] <= 1.0 and m["tokens_per_s"] > 0
    head = DraftHead.load(final)
    assert head.config.kind == "hass" and head.config.trained_on == "math"
    metrics = json.loads((final / "metrics.json").read_text())
    assert metrics["epoch"] == 1 and metrics["history"][0]["epoch"] == 1
    # a finished run is reused, not retrained
    assert train_head(cfg, "hass", "math", report=reports.append, target=target, progress=False) == final
    assert len(reports) == 1


def test_resume_after_kill_continues_from_last_epoch(base, tmp_path):
    cfg, target = fresh(base, tmp_path / "a", epochs=3)
    reports = []
    out = train_head(cfg, "eagle2", "math", report=reports.append, target=target, progress=False, stop_after_epochs=1)
    folder = head_dir(cfg, "eagle2", "math")
    assert out == folder / "epoch-1" and not (folder / "final").exists()
    # simulate the kill landing mid-way through writing epoch 2: a leftover staging folder
    (folder / ".epoch-2.tmp-123").mkdir()
    final = train_head(cfg, "eagle2", "math", report=reports.append, target=target, progress=False)
    assert [r["epoch"] for r in reports] == [1, 2, 3]  # epoch 1 was not redone
    assert not list(folder.glob(".*.tmp-*"))
    assert not (folder / "epoch-1" / "optimizer.pt").exists() and (folder / "epoch-3" / "optimizer.pt").exists()
    state = json.loads((final / "metrics.json").read_text())
    assert [h["epoch"] for h in state["history"]] == [1, 2, 3]

    # the resumed run ends where an uninterrupted one does
    cfg_b, _ = fresh(base, tmp_path / "b", epochs=3)
    straight = train_head(cfg_b, "eagle2", "math", target=target, progress=False)
    a, b = DraftHead.load(final).trainable_state(), DraftHead.load(straight).trainable_state()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key

    # changed settings: the old checkpoints are not resumed
    cfg.train.lr = 5e-4
    reports.clear()
    train_head(cfg, "eagle2", "math", report=reports.append, target=target, progress=False)
    assert [r["epoch"] for r in reports] == [1, 2, 3]


def test_max_tokens_budget(base, tmp_path):
    cfg, target = fresh(base, tmp_path, epochs=5, max_tokens=1)
    final = train_head(cfg, "eagle2", "chat", target=target, progress=False)
    state = json.loads((final / "metrics.json").read_text())
    assert state["epoch"] == 1 and state["step"] == 1


def _eagle_state(head: DraftHead, vocab: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in head.trainable_state().items():
        out[key.replace("layer.", "layers.0.", 1) if key.startswith("layer.") else key] = value.clone()
    out["embed_tokens.weight"] = torch.randn(vocab, head.config.hidden_size)
    return out


def test_eagle_checkpoint_keys_load(base, tmp_path):
    _, target = base
    config = target.model.config
    head = new_head(config, seed=3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = _eagle_state(head, config.vocab_size)
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.post_attention_layernorm.weight", "embed_tokens.weight"} <= set(state)
    loaded = load_eagle_checkpoint(state, config)
    for key, value in head.trainable_state().items():
        assert torch.equal(loaded.trainable_state()[key], value), key
    # from a file too, and the forward matches
    from safetensors.torch import save_file
    save_file(state, str(tmp_path / "model.safetensors"))
    from_file = load_eagle_checkpoint(tmp_path, config)
    x, f = torch.randn(1, 5, config.hidden_size), torch.randn(1, 5, config.hidden_size)
    pos, valid = torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool)
    assert torch.allclose(from_file(x, f, pos, causal_mask(valid))[0], head(x, f, pos, causal_mask(valid))[0])
    # a checkpoint without fc.bias builds a bias-free fc; a missing weight is an error, never ignored
    no_bias = {k: v for k, v in state.items() if k != "fc.bias"}
    assert load_eagle_checkpoint(no_bias, config).fc.bias is None
    broken = {k: v for k, v in state.items() if k != "layers.0.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="missing"):
        load_eagle_checkpoint(broken, config)


def test_save_load_round_trip(base, tmp_path):
    _, target = base
    head = new_head(target.model.config, seed=1, kind="hass", trained_on="math")
    head.save(tmp_path / "h")
    again = DraftHead.load(tmp_path / "h")
    assert again.config == head.config
    for key, value in head.trainable_state().items():
        assert torch.equal(again.trainable_state()[key], value)


def _files(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_agreement_and_heads_report(base, tmp_path, monkeypatch):
    cfg, target = fresh(base, tmp_path / "work")
    reports = tmp_path / "reports"
    # the report only reads: before training every head is marked, nothing is trained, extracted or measured
    before = _files(tmp_path / "work")
    text = build_heads_report(cfg, reports).read_text()
    assert _files(tmp_path / "work") == before
    assert text.count(NOT_TRAINED) == 4 * 4 + 4 and "eagle2-math" in text
    for mixture in cfg.train.mixtures:
        for kind in cfg.train.kinds:
            train_head(cfg, kind, mixture, target=target, progress=False)
    assert unmeasured_heads(cfg) == ["eagle2-math", "hass-math", "eagle2-chat", "hass-chat"]
    measured = measure_agreement(cfg, target)
    assert sorted(measured) == sorted(trained_heads(cfg)) and unmeasured_heads(cfg) == []
    heads = trained_heads(cfg)
    result = evaluate_agreement(cfg, heads["eagle2-math"], ["math", "chat"], target=target)
    for domain in ("math", "chat"):
        assert 0.0 <= result[domain]["acc"] <= 1.0 and result[domain]["tokens"] > 0
        assert result[domain]["acc"] == pytest.approx(measured["eagle2-math"][domain])

    def boom(*args, **kwargs):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(agreement_mod, "evaluate_agreement", boom)
    assert measure_agreement(cfg, target) == measured  # remembered, not evaluated again
    agreement_file(cfg, heads["hass-chat"]).unlink()  # a head measured before its data changed, say
    before = _files(tmp_path / "work")
    text = build_heads_report(cfg, reports).read_text()
    assert _files(tmp_path / "work") == before
    assert "tokens/s" in text and NOT_TRAINED not in text
    assert "| hass-chat | chat | " + " | ".join([NOT_MEASURED] * 4) + " |" in text
    assert f"| eagle2-math | math | **{measured['eagle2-math']['math']:.3f}**" in text
    summary = json.loads((reports / "heads.json").read_text())
    assert [h["path"] for h in summary["heads"]] == [str(p.relative_to(cfg.work_path())) for p in heads.values()]
    assert summary["machine"] and summary["features"]["math"]["tokens"] > 0
    (reports / "heads.md").unlink()
    assert rerender_heads_md(reports).read_text() == text


def test_greedy_answers_batched_match_unbatched_generate(base):
    cfg, target = base
    from taps_ray.data.chat import render_ids

    convs = build_mixture(cfg.mixtures["chat"], cfg.resolved_data_dir())[:3]
    prompts = [render_ids(target.tokenizer, c.messages[:1], add_generation_prompt=True)[:40] for c in convs]
    batched = greedy_answers(target, prompts, batch_size=3, max_new_tokens=5)
    for prompt, answer in zip(prompts, batched):
        x = torch.tensor([prompt])
        ref = target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False,
                                    pad_token_id=target.tokenizer.pad_token_id)[0, len(prompt):].tolist()
        stops = set(target.stop_token_ids)
        cut = next((k for k, tok in enumerate(ref) if tok in stops), len(ref))
        assert answer == ref[:cut]


def test_mixed_features_copy_single_domain_conversations(base, tmp_path):
    cfg, target = fresh(base, tmp_path)
    mixed = extract_features(cfg, "mixed", target=target, progress=False)
    assert mixed.stats["copied_conversations"] == mixed.stats["conversations"] > 0  # nothing recomputed but skips
    for ex in mixed.load()[:3]:
        (h, _, k, _), = features_mod.target_features(target, [ex.input_ids.tolist()], cfg.features.top_k)
        assert torch.allclose(ex.hidden.float(), h, rtol=2**-8, atol=1e-4) and torch.equal(ex.topk_ids[:, 0], k[:, 0])


def test_second_trainer_waits_for_the_first(base, tmp_path):
    """A process training the same head holds its lock; the other one blocks, then reuses the finished head."""
    import threading
    import time

    from taps_ray.fsio import folder_lock

    cfg, target = fresh(base, tmp_path)
    folder = head_dir(cfg, "eagle2", "chat")
    order = []

    def other_process():
        with folder_lock(folder):
            order.append("holder")
            time.sleep(0.5)
        order.append("released")

    # flock locks belong to open file descriptions, so a second open() in this process contends like another process
    thread = threading.Thread(target=other_process)
    thread.start()
    while not order:
        time.sleep(0.01)
    train_head(cfg, "eagle2", "chat", target=target, progress=False)
    order.append("trained")
    thread.join()
    assert order == ["holder", "released", "trained"]


TIMINGS = {"extract_s", "extract_cpu_s", "total_s", "total_cpu_s", "regenerate_s"}  # wall-clock, differ per run


def _shard_content(path: Path) -> tuple[dict, bytes]:
    """A safetensors shard as (its header, its tensor bytes), the timings in the header's metadata left out."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + size])
    meta = json.loads(header["__metadata__"].pop("meta"))
    return {**header, "meta": {k: v for k, v in meta.items() if k not in TIMINGS}}, raw[8 + size:]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_sharded_ray_features_match_the_in_process_shards_byte_for_byte(base, tmp_path, ray_session, num_workers):
    from taps_ray.study.target_tasks import extract_feature_sets

    cfg, target = base
    local = cfg.model_copy(deep=True, update={"work_dir": str(tmp_path / "local")})
    reference = extract_features(local, "chat", target=target, progress=False)
    sharded = cfg.model_copy(deep=True, update={"work_dir": str(tmp_path / "ray")})
    sharded.features.num_workers = num_workers
    sharded.ray.target_num_cpus = 0.25
    sharded.ray.torch_threads = torch.get_num_threads()  # the in-process extraction's: the same float sums

    stats = extract_feature_sets(sharded, {}, ["chat"])["chat"]
    folder = features_folder(sharded, "chat")
    shards = sorted(folder.glob("shard-*.safetensors"))
    assert [p.name for p in shards] == [Path(p).name for p in reference.shard_paths()] and len(shards) == 3
    assert stats["extracted_shards"] == 3 and not stats["reused"]
    for ours, theirs in zip(shards, reference.shard_paths()):
        assert _shard_content(ours) == _shard_content(theirs), ours.name
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [s["ids"] for s in manifest["shards"]] == [s["ids"] for s in reference.manifest["shards"]]

    # a killed sweep: no manifest, one shard missing; the rerun writes that shard alone, then the manifest
    (folder / "manifest.json").unlink()
    shards[1].unlink()
    mtimes = {p: p.stat().st_mtime_ns for p in (shards[0], shards[2])}
    again = extract_feature_sets(sharded, {}, ["chat"])["chat"]
    assert again["extracted_shards"] == 1 and again["conversations"] == stats["conversations"]
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
    assert _shard_content(shards[1]) == _shard_content(reference.shard_paths()[1])


def test_epoch_streams_a_few_shards_at_a_time():
    """Every training example once per epoch, never more than `window` shards per window, seeded per epoch."""
    entries = [Entry(f"c{s}-{i}", 5 + (7 * i + s) % 13, s) for s in range(10) for i in range(6)]
    windows = epoch_batches(entries, batch_size=4, seed=3, epoch=1, window=3)
    seen = [e for window in windows for batch in window for e in batch]
    assert sorted(seen, key=lambda e: e.id) == sorted(entries, key=lambda e: e.id)
    assert [len({e.shard for batch in w for e in batch}) for w in windows] == [3, 3, 3, 1]
    assert all(len(batch) <= 4 for w in windows for batch in w)
    assert epoch_batches(entries, 4, 3, 1, 3) == windows  # a resumed run replays the epoch
    assert epoch_batches(entries, 4, 3, 2, 3) != windows
    held = heldout_batches(entries, 4, 3)
    assert [sorted({e.shard for batch in w for e in batch}) for w in held] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    lengths = [len(e) for batch in held[0] for e in batch]
    assert lengths == sorted(lengths)


def test_mixed_features_are_copied_by_the_driver_without_the_target(base, tmp_path, monkeypatch):
    """A set its donors cover is written before any task starts: no shard is left for a task holding the
    target, and the target is never loaded (the paper's mixed sets cost no GPU task)."""
    import shutil

    cfg = base[0].model_copy(deep=True, update={"work_dir": str(tmp_path)})
    for name in ("math", "chat"):  # the donors alone (the module's features root may hold a mixed set already)
        shutil.copytree(features_folder(base[0], name), features_folder(cfg, name))

    def no_target(*_args, **_kwargs):
        raise AssertionError("the target was loaded for a set its donors cover")

    monkeypatch.setattr(features_mod, "load_target", no_target)
    handed = []
    mixed = extract_features(cfg, "mixed", progress=False,
                             run_shards=lambda plan, missing: (handed.append(missing), (0, None))[1])
    assert handed == [[]]
    assert mixed.stats["copied_conversations"] == mixed.stats["conversations"] > 0
    assert mixed.stats["computed_tokens"] == 0


def test_training_on_cached_features_reads_only_the_embeddings_and_lm_head(base, tmp_path, monkeypatch):
    """A trial without a target loads `load_training_target` (no decoder layer) and trains the very head that
    training with the whole target does."""
    from safetensors.torch import load_file

    from taps_ray.models.draft_parts import load_training_target

    whole_cfg, target = fresh(base, tmp_path / "whole", max_tokens=600)
    with_whole = train_head(whole_cfg, "eagle2", "math", target=target, progress=False)
    parts_cfg, _ = fresh(base, tmp_path / "parts", max_tokens=600)

    def no_target(*_args, **_kwargs):
        raise AssertionError("training on cached features loaded the whole target")

    monkeypatch.setattr(features_mod, "load_target", no_target)
    with_parts = train_head(parts_cfg, "eagle2", "math", progress=False)
    ours, theirs = load_file(with_parts / "model.safetensors"), load_file(with_whole / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    parts = load_training_target(whole_cfg.target).model
    assert {name.split(".")[0] for name, _ in parts.named_parameters()} <= {"embed_tokens", "lm_head"}
    assert parts.config.hidden_size == target.model.config.hidden_size
