"""Target answers: the per-mixture `answers` switch, multi-turn regeneration, its resumable cache, the compare
heads (dataset-answer twins) in training, evaluation and the heads report."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from taps_ray.config import ConfigError, StudyConfig, load_config, parse_config
from taps_ray.data.chat import render_ids
from taps_ray.data.mixtures import build_mixture
from taps_ray.eval.commands import plan_cells
from taps_ray.models.draft_head import new_head
from taps_ray.models.target import Target
from taps_ray.drafting.setup import heads_needed, load_proposers
from taps_ray.drafting.registry import proposer_names
from taps_ray.report.heads import heads_summary, render_heads_md
from taps_ray.training import answers as answers_mod
from taps_ray.training.answers import AnswerCache, regenerate_answers
from taps_ray.training.features import (
    answers_path, conversation_digest, extract_features, feature_spec, features_key,
)
from taps_ray.workdir import results_dir

REPO = Path(__file__).resolve().parents[1]


def _with_twins(cfg: StudyConfig, **updates) -> StudyConfig:
    """`cfg` with math and chat on target answers and their dataset-answer twins as eagle2 compare heads."""
    data = cfg.model_dump()
    mixtures = data["mixtures"]
    for name in ("math", "chat"):
        mixtures[f"{name}-dataset"] = {**mixtures[name], "answers": "dataset"}
        mixtures[name]["answers"] = "target"
    data["train"]["compare"] = {"math-dataset": ["eagle2"], "chat-dataset": ["eagle2"]}
    data.update(updates)
    return parse_config(data)


class Scripted:
    """Stands in for `greedy_answers`: answer k of a conversation is "reply k", except where `empty` says
    (prompt text contains a key) the answer comes out empty; records every prompt it was asked."""

    def __init__(self, target: Target, empty: tuple[str, ...] = ()) -> None:
        self.tok, self.empty, self.prompts = target.tokenizer, empty, []

    def __call__(self, target, prompts, batch_size, max_new_tokens, bar=None):
        self.prompts.append([self.tok.decode(p) for p in prompts])
        out = []
        for text in self.prompts[-1]:
            k = text.count("<|im_start|>assistant") - 1  # earlier answers in the history
            blank = any(key in text for key in self.empty)
            out.append([] if blank else self.tok.encode(f" reply {k}", add_special_tokens=False))
        return out


def _chat(cfg: StudyConfig, n: int = 6) -> list:
    return build_mixture(cfg.mixtures["chat"], cfg.resolved_data_dir())[:n]


def _users(conv) -> list[dict]:
    return [m for m in conv.messages if m["role"] == "user" and m["content"].strip()]


# --- config ------------------------------------------------------------------------------------------------------

def test_answers_per_mixture_and_compare_heads_parse(tiny_config):
    cfg = _with_twins(tiny_config)
    assert cfg.mixtures["math"].answers == "target" and cfg.mixtures["math-dataset"].answers == "dataset"
    assert cfg.mixtures["mixed"].answers == "dataset"  # the default: the paper's setting
    assert cfg.head_pairs() == [("eagle2", "math"), ("hass", "math"), ("eagle2", "chat"), ("hass", "chat"),
                                ("eagle2", "math-dataset"), ("eagle2", "chat-dataset")]
    assert cfg.head_mixtures("hass") == ["math", "chat"]
    assert cfg.head_mixtures() == ["math", "chat", "math-dataset", "chat-dataset"]
    data = cfg.model_dump()
    with pytest.raises(ConfigError, match="train.compare names \\['nope'\\]"):
        parse_config({**data, "train": {**data["train"], "compare": {"nope": ["eagle2"]}}})
    with pytest.raises(ConfigError, match="trains already"):
        parse_config({**data, "train": {**data["train"], "compare": {"math": ["eagle2"]}}})
    with pytest.raises(ConfigError, match="mixtures.math.answers"):
        parse_config({**data, "mixtures": {**data["mixtures"], "math": {**data["mixtures"]["math"], "answers": "human"}}})
    with pytest.raises(ConfigError, match="now per mixture"):
        parse_config({**data, "features": {**data["features"], "regenerate_answers": True}})


def test_the_study_follows_taps_recipe_with_target_answer_twins():
    """configs/cpu.yaml: the data sets' answers, TAPS's mixture shapes (math, chat, the 1:1 mix and the doubled mix,
    both mixes inside the math and chat samples so their features are copied), few epochs; the target-answer heads
    stay as twins that draft alone. speed.yaml's deployment heads keep the target's answers."""
    cpu, speed = load_config(REPO / "configs" / "cpu.yaml"), load_config(REPO / "configs" / "speed.yaml")
    assert cpu.train.mixtures == ["math", "chat", "mixed", "mixed-2x"]
    assert {cpu.mixtures[m].answers for m in cpu.train.mixtures} == {"dataset"}
    math, chat, mixed, doubled = (cpu.mixtures[m] for m in cpu.train.mixtures)
    assert mixed.mixture == doubled.mixture == {"mathinstruct": 0.5, "sharegpt": 0.5}
    assert mixed.size == (math.size + chat.size) // 2 and doubled.size == math.size + chat.size
    assert cpu.train.epochs <= 2
    assert cpu.train.compare == {"math-target": ["eagle2"], "chat-target": ["eagle2"]}
    assert {cpu.mixtures[m].answers for m in cpu.train.compare} == {"target"}
    assert {"math-target", "chat-target", "mixed-2x", "learned-routed"} <= set(cpu.eval.proposers)
    assert "learned-routed" in cpu.eval.live_proposers
    assert {speed.mixtures[m].answers for m in speed.train.mixtures} == {"target"}


def test_feature_key_follows_the_answers(tiny_config):
    cfg = _with_twins(tiny_config)
    dataset, target = feature_spec(cfg, "math-dataset"), feature_spec(cfg, "math")
    assert dataset == feature_spec(tiny_config, "math")  # dataset-answer keys are what they were
    assert dataset["regenerate"] is None and "answers" not in dataset["mixture"]
    assert target["regenerate"] == {"max_new_tokens": cfg.features.regenerate_max_new_tokens, "turns": "all"}
    assert features_key(cfg, "math") != features_key(tiny_config, "math")
    longer = cfg.model_copy(deep=True)
    longer.features.regenerate_max_new_tokens += 1
    assert features_key(longer, "math") != features_key(cfg, "math")
    assert features_key(longer, "math-dataset") == features_key(cfg, "math-dataset")


# --- regeneration ------------------------------------------------------------------------------------------------

def test_every_user_turn_is_answered_in_order_with_the_targets_own_history(tiny_config, tiny_target, monkeypatch):
    convs = _chat(tiny_config)
    assert max(len(_users(c)) for c in convs) >= 3
    scripted = Scripted(tiny_target)
    monkeypatch.setattr(answers_mod, "greedy_answers", scripted)
    out = regenerate_answers(tiny_target, convs, batch_size=8, max_new_tokens=8, max_len=100_000)
    assert [c.id for c in out] == [c.id for c in convs]
    for new, old in zip(out, convs):
        users = _users(old)
        assert new.messages[0::2] == users  # every user turn, in order, nothing else of the source
        assert [m["content"] for m in new.messages[1::2]] == [f"reply {k}" for k in range(len(users))]
    # one batched generate per turn, over the conversations that still have a turn to answer
    assert [len(p) for p in scripted.prompts] == [sum(len(_users(c)) > k for c in convs)
                                                  for k in range(max(len(_users(c)) for c in convs))]
    second = scripted.prompts[1][0]
    assert "reply 0" in second and all(m["content"] not in second for m in convs[0].messages if m["role"] == "assistant")


def test_regeneration_stops_at_an_empty_answer_and_at_max_len(tiny_config, tiny_target, monkeypatch):
    convs = [c for c in _chat(tiny_config, 24) if len(_users(c)) >= 3][:3]
    blank_first, blank_second = _users(convs[0])[0]["content"], _users(convs[1])[1]["content"]
    monkeypatch.setattr(answers_mod, "greedy_answers", Scripted(tiny_target, empty=(blank_first[:40], blank_second[:40])))
    out = {c.id: c for c in regenerate_answers(tiny_target, convs, 8, 8, max_len=100_000)}
    assert convs[0].id not in out  # no first answer: dropped
    assert len(out[convs[1].id].messages) == 2  # stopped at the empty second answer
    # a max_len that fits the first two turns but not the third prompt
    two = render_ids(tiny_target.tokenizer, [*out[convs[2].id].messages[:2], _users(convs[2])[1]], add_generation_prompt=True)
    tight = len(two) + answers_mod.PROMPT_MARGIN + 5
    monkeypatch.setattr(answers_mod, "greedy_answers", Scripted(tiny_target))
    cut = regenerate_answers(tiny_target, convs[2:], 8, 8, max_len=tight)[0]
    assert len(cut.messages) == 4


def test_answer_cache_resumes_without_regenerating(tiny_config, tiny_target, monkeypatch, tmp_path):
    convs = _chat(tiny_config)
    sources = {c.id: conversation_digest(c) for c in convs}
    monkeypatch.setattr(answers_mod, "greedy_answers", Scripted(tiny_target))
    first = regenerate_answers(tiny_target, convs, 4, 8, 100_000, AnswerCache(tmp_path / "a.jsonl", sources))
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == len(convs)  # one line per conversation

    def boom(*args, **kwargs):
        raise AssertionError("regenerated again")

    monkeypatch.setattr(answers_mod, "greedy_answers", boom)
    assert regenerate_answers(tiny_target, convs, 4, 8, 100_000, AnswerCache(tmp_path / "a.jsonl", sources)) == first
    # a torn last line (a killed write) and a changed source are regenerated, the rest is not
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
    changed = {**sources, convs[0].id: "other"}
    cache = AnswerCache(tmp_path / "a.jsonl", changed)
    assert convs[0].id not in cache and convs[-1].id not in cache and convs[1].id in cache
    scripted = Scripted(tiny_target)
    monkeypatch.setattr(answers_mod, "greedy_answers", scripted)
    assert regenerate_answers(tiny_target, convs, 4, 8, 100_000, cache) == first
    assert len(scripted.prompts[0]) == 2


def test_extraction_on_target_answers_resumes_without_regenerating(tiny_config, tiny_target, monkeypatch, tmp_path):
    cfg = _with_twins(tiny_config, work_dir=str(tmp_path))
    cfg.features.shard_size = 12
    monkeypatch.setattr(answers_mod, "greedy_answers", Scripted(tiny_target))
    fs = extract_features(cfg, "chat", target=tiny_target, progress=False)
    assert fs.stats["conversations"] > 0 and fs.stats["regenerate_s"] is not None
    for ex in fs.load():
        assert tiny_target.tokenizer.decode(ex.input_ids[ex.loss_mask.bool()].tolist()).startswith("reply 0")
    shard = fs.shard_paths()[0]
    assert answers_path(shard).is_file()
    shard.unlink()  # a run killed after regenerating, before the shard was written
    (fs.folder / "manifest.json").unlink()

    def boom(*args, **kwargs):
        raise AssertionError("regenerated again")

    monkeypatch.setattr(answers_mod, "greedy_answers", boom)
    again = extract_features(cfg, "chat", target=tiny_target, progress=False)
    assert [e.input_ids.tolist() for e in again.load()] == [e.input_ids.tolist() for e in fs.load()]
    twin = extract_features(cfg, "chat-dataset", target=tiny_target, progress=False)  # nothing copied across answers
    assert twin.folder != fs.folder and twin.stats["copied_conversations"] == 0


# --- compare heads in evaluation and the report -------------------------------------------------------------------

def test_compare_heads_draft_alone_and_only_for_their_kinds(tiny_config, tiny_target):
    cfg = _with_twins(tiny_config)
    cfg.eval.proposers = ["math", "math-dataset", "entropy-routed"]
    assert {"math-dataset", "chat-dataset", "math-dataset+ngram"} <= set(proposer_names(cfg))
    cells = {(c.head_kind, c.proposer) for c in plan_cells(cfg) if c.head_kind != "none"}
    assert cells == {("eagle2", "math"), ("hass", "math"), ("eagle2", "math-dataset"), ("eagle2", "entropy-routed"),
                     ("hass", "entropy-routed")}
    assert heads_needed(cfg, ["math-dataset+ngram"]) == ["math-dataset"]
    assert heads_needed(cfg, ["entropy-routed"]) == ["math", "chat"]
    heads = {m: new_head(tiny_target.model.config, seed=i) for i, m in enumerate(cfg.head_mixtures("eagle2"))}
    proposers = load_proposers(cfg, ["math-dataset", "entropy-routed"], target=tiny_target, heads=heads)
    assert [h for h in proposers["entropy-routed"].head_names if h != "averaged"] == ["math", "chat"]  # twins never combined
    assert proposers["math-dataset"].head is heads["math-dataset"]


def test_heads_report_compares_dataset_and_target_answers(tiny_config, tmp_path, monkeypatch):
    cfg = _with_twins(tiny_config, work_dir=str(tmp_path))
    accuracy = {"eagle2-math": 0.61, "eagle2-math-dataset": 0.52, "eagle2-chat": 0.44}  # by head folder
    monkeypatch.setattr("taps_ray.report.heads.read_agreement", lambda c, final, domains: {
        d: {"acc": accuracy[final.parent.name], "acc_2": 0.3, "tokens": 10, "conversations": 2} for d in domains})
    for label in accuracy:
        final = cfg.work_path("heads", label, "final")
        final.mkdir(parents=True)
        (final / "model.safetensors").write_bytes(b"")
        (final / "metrics.json").write_text(json.dumps({"step": 1, "tokens": 10, "train_seconds": 1.0, "history": []}))
    results_dir(cfg).mkdir(parents=True)
    pd.DataFrame([
        {"head_kind": "eagle2", "proposer": "math", "benchmark": "gsm8k", "temperature": 0.0, "new_tokens": 30, "steps": 10},
        {"head_kind": "eagle2", "proposer": "math", "benchmark": "svamp", "temperature": 0.0, "new_tokens": 10, "steps": 10},
        {"head_kind": "eagle2", "proposer": "math", "benchmark": "gsm8k", "temperature": 1.0, "new_tokens": 99, "steps": 1},
        {"head_kind": "eagle2", "proposer": "math-dataset", "benchmark": "gsm8k", "temperature": 0.0, "new_tokens": 15,
         "steps": 10},
        {"head_kind": "eagle2", "proposer": "math-dataset", "benchmark": "mt_bench", "temperature": 0.0,
         "new_tokens": 99, "steps": 1},
    ]).to_parquet(results_dir(cfg) / "summary.parquet")
    summary = heads_summary(cfg)
    math, chat = summary["comparison"]
    assert math == {"kind": "eagle2", "domain": "math", "heads": {"target": "math", "dataset": "math-dataset"},
                    "acc": {"target": 0.61, "dataset": 0.52}, "acc_2": {"target": 0.3, "dataset": 0.3},
                    "tau": {"target": 2.0, "dataset": 1.5}}
    assert chat["acc"] == {"target": 0.44, "dataset": None} and chat["tau"] == {"target": None, "dataset": None}
    text = render_heads_md(summary, ("math", "chat"))
    assert "## Dataset answers vs target answers" in text
    assert "| math | eagle2 | eagle2-math-dataset / eagle2-math | 0.520 | 0.610 | 0.300 | 0.300 | 1.500 | 2.000 |" in text
    assert "| chat | eagle2 | eagle2-chat-dataset / eagle2-chat | – | 0.440 | – | 0.300 | – | – |" in text
    assert "`math` 24 conversations (mathinstruct 1, target answers)" in text
    # what each head's budget bought: its data, its minutes and its own tau per domain (math-dataset on MT-Bench 99)
    assert "## What each head's budget bought" in text
    assert "| eagle2-math | target | 24 | 1.0 | 10 | 0.0 | 0.0 | 2.00 | – |" in text
    assert "| eagle2-math-dataset | dataset | 24 | 1.0 | 10 | 0.0 | 0.0 | 1.50 | 99.00 |" in text
