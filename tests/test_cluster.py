"""The Ray system on the tiny random target: actors give the in-process tokens, batching across sessions,
actor deaths retried, persistent failures recorded, the sweep resumes, Tune restores, cluster.yaml is valid.

One Ray session for everything (`ray_session`); actors ask for fractions of a CPU so they coexist.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from taps_ray.study.actors import pack_heads, unpack_heads
from taps_ray.study.eval_pool import EvalPool
from taps_ray.decoding.verification_pool import VerificationPool
from taps_ray.config import StudyConfig
from taps_ray.eval.commands import plan_cells
from taps_ray.eval.runner import run_cell
from taps_ray.eval.cell import Cell
from taps_ray.eval.store import ResultsStore
from taps_ray.models.draft_head import DraftHead, new_head
from taps_ray.drafting.setup import load_heads
from taps_ray.decoding.generate import generate, run_loop
from taps_ray.drafting.registry import build_proposer
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.workdir import head_checkpoint, head_dir, heads_root, results_dir

REPO = Path(__file__).resolve().parents[1]

CELLS = [  # multi-turn greedy, routed sampling, merged trees sampling
    Cell("eagle2", "math", "mt_bench", 0.0),
    Cell("eagle2", "confidence-routed", "gsm8k", 1.0),
    Cell("eagle2", "merged", "gsm8k", 1.0),
]


def _config(base: StudyConfig, work: Path, **ray_overrides) -> StudyConfig:
    evaluation = base.eval.model_copy(
        update={"benchmarks": {"mt_bench": 1, "gsm8k": 2}, "max_new_tokens": 6, "batch_size": 2, "temperatures": [0.0]}
    )
    train = base.train.model_copy(update={"kinds": ["eagle2"], "mixtures": ["math", "chat"]})
    ray_cfg = base.ray.model_copy(
        update={
            "torch_threads": 2,
            "target_num_cpus": 0.1,
            "drafter_num_cpus": 0.1,
            "trial_cpus": 0.25,
            "max_cell_retries": 1,
            "actor_max_restarts": 6,
            "max_wait_ms": 5.0,
            **ray_overrides,
        }
    )
    return base.model_copy(
        update={"eval": evaluation, "train": train, "ray": ray_cfg, "work_dir": str(work), "reports_dir": str(work / "reports")}
    )


@pytest.fixture(scope="module")
def cfg(tiny_config, tiny_target, tmp_path_factory) -> StudyConfig:
    config = _config(tiny_config, tmp_path_factory.mktemp("cluster-work"))
    for seed, mixture in enumerate(config.train.mixtures, start=1):
        new_head(tiny_target.model.config, seed=seed, kind="eagle2", trained_on=mixture).save(head_checkpoint(config, "eagle2", mixture))
    return config


@pytest.fixture(scope="module")
def reference(cfg, tiny_target) -> dict[str, pd.DataFrame]:
    heads = load_heads(cfg, "eagle2", torch.float32)
    return {cell.id: pd.DataFrame(run_cell(cfg, cell, tiny_target, heads)[1]) for cell in CELLS}


@pytest.fixture(scope="module")
def pool(ray_session, cfg):
    with EvalPool(cfg, pack_heads(cfg, ["eagle2"])) as eval_pool:
        eval_pool.ready(timeout=300)
        yield eval_pool


def _tokens(questions: pd.DataFrame) -> list[tuple[str, int, list[int]]]:
    rows = questions.sort_values(["question_id", "turn"])
    return [(q, t, [int(x) for x in tokens]) for q, t, tokens in zip(rows.question_id, rows.turn, rows.tokens)]


def _stored(store: ResultsStore, cell: Cell) -> pd.DataFrame:
    return pd.read_parquet(store.cell_dir(cell) / "questions.parquet")


# --- actors vs in-process ------------------------------------------------------------------------------------


def test_actors_give_the_in_process_tokens(pool, cfg, reference, tmp_path):
    store = ResultsStore(tmp_path / "results")
    report = pool.run(CELLS, store, log_line=lambda _: None)
    assert report.done == [c.id for c in CELLS] and not report.failed
    for cell in CELLS:
        assert store.is_done(cell)
        assert _tokens(_stored(store, cell)) == _tokens(reference[cell.id]), cell.id
        # The worker verifies sessions in one batch, the reference one sequence alone: features round differently
        # (tests/numerics.py), so a draft may part at a near-tie and a turn take a step more or fewer.
        steps, expected = len(pd.read_parquet(store.cell_dir(cell) / "steps.parquet")), reference[cell.id]["steps"].sum()
        assert abs(steps - expected) <= max(1, expected // 10), (cell.id, steps, expected)
    stats = report.worker_stats[0]
    assert stats["forwards"] > 0 and stats["open_sessions"] == 0


def _placement(actor) -> tuple[str, str]:
    """(placement group id, node id) of a live actor, as the GCS records it."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    info = gcs_pb2.ActorTableData.FromString(state._connect_and_get_accessor().get_actor_info(actor._actor_id))
    return info.placement_group_id.hex(), info.address.node_id.hex()


def test_each_worker_and_its_drafters_share_one_placement_group(ray_session, cfg):
    ray = ray_session
    two = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"num_target_workers": 2, "num_drafters": 3})})
    with EvalPool(two, pack_heads(two, ["eagle2"])) as pool:
        pool.ready(timeout=300)
        groups = list(pool.groups)
        tables = [ray.util.placement_group_table(g) for g in groups]
        assert [t["strategy"] for t in tables] == ["PACK", "PACK"] and {t["state"] for t in tables} == {"CREATED"}
        # worker 0 with drafters 0 and 2, worker 1 with drafter 1: one bundle each, the worker's first
        assert [len(t["bundles"]) for t in tables] == [3, 2]
        assert all(b == {"CPU": 0.1} for t in tables for b in t["bundles"].values())
        members = [[pool.workers[0], pool.drafters[0], pool.drafters[2]], [pool.workers[1], pool.drafters[1]]]
        for group, table, actors in zip(groups, tables, members):
            for index, actor in enumerate(actors):
                group_id, node_id = _placement(actor)
                assert group_id == group.id.hex() and node_id == table["bundles_to_node_id"][index]
    assert {ray.util.placement_group_table(g)["state"] for g in groups} == {"REMOVED"}  # shutdown frees the bundles


def test_shipped_heads_load_as_saved_and_leave_no_files(cfg, tmp_path, monkeypatch):
    """A drafter's heads arrive as bytes; loading them must give the saved weights and write nothing to the node's
    disk (a killed actor runs no clean-up, so a folder kept for its lifetime leaked)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    heads = unpack_heads(cfg, "eagle2", pack_heads(cfg, ["eagle2"]), torch.float32, torch.device("cpu"))
    saved = load_heads(cfg, "eagle2", torch.float32)
    assert sorted(heads) == sorted(saved) == sorted(cfg.train.mixtures)
    for mixture, head in heads.items():
        ours, theirs = head.trainable_state(), saved[mixture].trainable_state()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not list(tmp_path.iterdir())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DraftHead.from_files({"config.json": b"{}"})


# --- batching across sessions (no Ray: the worker's core) ------------------------------------------------------


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class _Proxy:
    def __init__(self, runner: _LoopThread, pool: VerificationPool) -> None:
        self.runner, self.pool, self.sid = runner, pool, None

    def start(self, prompts, params, seeds):
        self.sid, committed = self.runner.call(self.pool.start(prompts, params, seeds, "t"))
        return committed

    def step(self, trees):
        return self.runner.call(self.pool.step(self.sid, trees))


@pytest.mark.parametrize("wait_ms", [200.0, 0.0], ids=["gathered", "partial"])
def test_worker_gathers_sessions_into_one_forward(tiny_target, cfg, wait_ms):
    heads = load_heads(cfg, "eagle2", torch.float32)
    proposer = lambda: build_proposer("math", tiny_target, heads, cfg.tree)  # noqa: E731
    stops = tiny_target.stop_token_ids
    prompt_sets = [[[1, 5, 9, 14, 3], [1, 7, 2]], [[1, 22, 8], [1, 4, 4, 4, 6, 11, 2]]]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)]  # rows keep their own parameters
    seeds = [[11, 12], [13, 14]]  # the T = 0.8 rows' draws, the same in both runs
    expected = [[g.tokens for g in generate(tiny_target.model, proposer(), p, r, 8, stops, seeds=s)]
                for p, r, s in zip(prompt_sets, params, seeds)]

    runner = _LoopThread()
    pool = VerificationPool(tiny_target.model, max_batch=4, max_wait_ms=wait_ms)
    try:
        results: list = [None, None]

        def drafter(i: int) -> None:
            results[i] = [g.tokens for g in run_loop(_Proxy(runner, pool), proposer(), prompt_sets[i], params[i], 8,
                                                     stops, seeds=seeds[i])]

        threads = [threading.Thread(target=drafter, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        stats = pool.describe()
    finally:
        runner.stop()
    assert results == expected
    assert stats["merged_sessions"] == 1  # the second drafter's session joined the first one's cache, its own T and all
    if wait_ms:  # waiting long enough gathers both sessions' trees into one forward
        assert stats["batch_histogram"].get(4, 0) > 0


@pytest.mark.parametrize("stepped", [[1], [2, 1]], ids=["copied-out", "in-place"])
def test_stepping_some_rows_leaves_the_others_untouched(tiny_target, cfg, stepped):
    """One of three rows steps on a copy of its cache; two of three step in place beside a padded row: either
    way each stepped row commits what it commits alone and the others keep their cache and length."""
    heads = load_heads(cfg, "eagle2", torch.float32)
    proposer = build_proposer("math", tiny_target, heads, cfg.tree)
    params = SamplingParams(temperature=1.0)
    prompts = [[1, 5, 9, 14, 3], [1, 7, 2], [1, 22, 8, 8]]
    shared = TargetBatch(tiny_target.model)
    started = shared.start(prompts, params, [0, 1, 2])
    trees = [proposer.propose(proposer.init_state(), started[r].features, started[r].next_tokens)[0] for r in stepped]
    still = [r for r in range(3) if r not in stepped]
    layers = range(shared.cache.num_layers)
    before = [shared.cache.layer(i)[0][still].clone() for i in layers]
    got = shared.step(trees, stepped)
    lengths = [len(p) for p in prompts]
    for row, tree, result in zip(stepped, trees, got):
        alone = TargetBatch(tiny_target.model)
        alone.start([prompts[row]], params, [row])
        want = alone.step([tree])[0]
        assert result.tokens == want.tokens
        torch.testing.assert_close(result.features, want.features)
        lengths[row] = int(alone.lengths[0])
    assert shared.lengths.tolist() == lengths
    for i, old in zip(layers, before):
        keys = shared.cache.layer(i)[0]
        torch.testing.assert_close(keys[still, :, : old.shape[2]], old)
        assert keys.shape[2] == int(shared.lengths.max())
    assert shared.batch_size == 3 and shared.live == [0, 1, 2]  # rows sitting out stay in the cache


def test_merge_and_select_keep_each_sequence(tiny_target):
    params = SamplingParams()
    a, b, both = (TargetBatch(tiny_target.model) for _ in range(3))
    a.start([[1, 5, 9, 14, 3]], params, [0])
    b.start([[1, 7, 2]], params, [1])
    both.start([[1, 5, 9, 14, 3], [1, 7, 2]], params, [0, 1])
    a.merge(b)
    assert a.lengths.tolist() == both.lengths.tolist() == [5, 3] and a.live == [0, 1] and a.joined == 2
    for i in range(a.cache.num_layers):
        for row, n in enumerate((5, 3)):
            for mine, theirs in zip(a.cache.layer(i), both.cache.layer(i)):
                torch.testing.assert_close(mine[row, :, :n], theirs[row, :, :n])
    a.keep_rows([1])
    assert a.lengths.tolist() == [3] and a.cache.width == 3 and a.live == [1]


# --- fault tolerance -------------------------------------------------------------------------------------------


def test_killed_target_worker_mid_cell_is_retried(ray_session, pool, reference, tmp_path):
    ray = ray_session
    cell = CELLS[0]  # two turns: enough verification steps to kill in the middle
    store = ResultsStore(tmp_path / "results")
    worker = pool.workers[0]
    before = ray.get(worker.stats.remote())["forwards"]
    killed = threading.Event()

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if ray.get(worker.stats.remote())["forwards"] >= before + 2:
                ray.kill(worker, no_restart=False)
                killed.set()
                return
            time.sleep(0.02)

    def on_submit(submitted: Cell, attempt: int, drafter) -> None:
        if attempt == 0:
            threading.Thread(target=killer, daemon=True).start()

    report = pool.run([cell], store, on_submit=on_submit, log_line=lambda _: None)
    assert killed.is_set()
    assert report.retries >= 1 and report.done == [cell.id]
    assert json.loads((store.cell_dir(cell) / "done.json").read_text())["attempts"] >= 2
    assert _tokens(_stored(store, cell)) == _tokens(reference[cell.id])


def test_cell_that_keeps_failing_is_recorded_and_the_rest_complete(ray_session, pool, cfg, tmp_path):
    ray = ray_session
    good = [Cell("none", "plain", "gsm8k", 0.0), Cell("eagle2", "math", "gsm8k", 0.0)]
    doomed = Cell("eagle2", "chat", "gsm8k", 0.0)  # its drafter is killed on every attempt
    broken = Cell("eagle2", "no-such-proposer", "gsm8k", 0.0)  # a plain error: no retry
    store = ResultsStore(tmp_path / "results")

    def on_submit(cell: Cell, attempt: int, drafter) -> None:
        if cell == doomed:
            ray.kill(drafter, no_restart=False)

    report = pool.run([good[0], doomed, broken, good[1]], store, on_submit=on_submit, log_line=lambda _: None)
    assert sorted(report.done) == sorted(c.id for c in good)
    assert sorted(report.failed) == sorted([doomed.id, broken.id])
    failures = {f["proposer"]: f for f in store.failures()}
    assert failures["chat"]["attempts"] == cfg.ray.max_cell_retries + 1
    assert failures["chat"]["error"].split(":")[0] in ("ActorDiedError", "ActorUnavailableError", "RayActorError")
    assert failures["no-such-proposer"]["attempts"] == 1
    assert all(store.is_done(c) for c in good) and not store.is_done(doomed) and not store.is_done(broken)


# --- sweep: killed driver, rerun -------------------------------------------------------------------------------


class _Crash(RuntimeError):
    pass


def test_sweep_eval_resumes_after_a_crash(ray_session, cfg):
    from taps_ray.study.sweep import run_sweep

    sweep_cfg = cfg.model_copy(
        update={"eval": cfg.eval.model_copy(update={"proposers": ["math"], "benchmarks": {"gsm8k": 1, "mt_bench": 1}})}
    )
    cells = plan_cells(sweep_cfg)
    assert len(cells) == 4
    store = ResultsStore(results_dir(sweep_cfg))
    finished: list[Cell] = []

    def crash_after_two(cell: Cell) -> None:
        finished.append(cell)
        if len(finished) == 2:
            raise _Crash("driver killed")

    with pytest.raises(_Crash):
        run_sweep(sweep_cfg, stages=["eval"], on_cell_done=crash_after_two, log=lambda _: None)
    assert sum(store.is_done(c) for c in cells) == 2
    mtimes = {c.id: (store.cell_dir(c) / "done.json").stat().st_mtime_ns for c in finished}
    half = next(c for c in cells if not store.is_done(c))  # a half-written cell: data but no done.json
    store.cell_dir(half).mkdir(parents=True, exist_ok=True)
    (store.cell_dir(half) / "steps.parquet").write_bytes(b"partial")

    result = run_sweep(sweep_cfg, stages=["eval"], log=lambda _: None)
    evaluation = result["stages"]["eval"]
    assert evaluation["skipped"] == 2 and sorted(evaluation["done"]) == sorted(c.id for c in cells if c not in finished)
    assert all(store.is_done(c) for c in cells)
    assert {c.id: (store.cell_dir(c) / "done.json").stat().st_mtime_ns for c in finished} == mtimes
    assert len(pd.read_parquet(store.cell_dir(half) / "steps.parquet")) > 0
    summary = pd.read_parquet(store.root / "summary.parquet")
    assert len(summary) == 4

    again = run_sweep(sweep_cfg, stages=["eval"], log=lambda _: None)["stages"]["eval"]
    assert again["skipped"] == 4 and again["done"] == []


def test_sweep_report_stage_only_reads(ray_session, cfg):
    from taps_ray.study.sweep import run_sweep

    work = Path(cfg.work_dir)

    def inputs() -> dict[Path, int]:  # everything but what the stage writes: the reports, sweep.json, its config
        return {p: p.stat().st_mtime_ns for p in work.rglob("*")
                if p.relative_to(work).parts[0] != "reports" and p.name not in ("sweep.json", "config.yaml")}

    before = inputs()
    report = run_sweep(cfg, stages=["report"], log=lambda _: None)["stages"]["report"]
    assert inputs() == before  # nothing extracted, trained or measured
    assert Path(report["path"]).is_file()
    heads = Path(report["heads"]).read_text()
    assert "| eagle2-math | math | not trained | not trained |" in heads  # saved untrained heads: no metrics
    assert "| math | not extracted |" in heads


# --- Tune ----------------------------------------------------------------------------------------------------


def test_tune_stage_resumes_and_skips_finished_heads(ray_session, tiny_config, tiny_target, tmp_path):
    from taps_ray.study.tune import head_finished, run_training
    from taps_ray.training.features import extract_features
    from taps_ray.training.trainer import train_head

    base = _config(tiny_config, tmp_path / "work")
    cfg = base.model_copy(update={"train": base.train.model_copy(update={"epochs": 2})})
    for mixture in cfg.train.mixtures:
        extract_features(cfg, mixture, target=tiny_target, progress=False)
    heads, math = heads_root(cfg), head_dir(cfg, "eagle2", "math")
    # a trial killed after its first epoch: epoch-1 exists, no final
    train_head(cfg, "eagle2", "math", target=tiny_target, progress=False, stop_after_epochs=1)
    epoch1 = math / "epoch-1" / "model.safetensors"
    first_epoch_mtime = epoch1.stat().st_mtime_ns
    assert not head_finished(cfg, "eagle2", "math")

    result = run_training(cfg, log_line=lambda _: None)
    assert sorted(result["trained"]) == ["eagle2-chat", "eagle2-math"] and not result["failed"]
    assert epoch1.stat().st_mtime_ns == first_epoch_mtime  # resumed, not retrained
    assert (math / "epoch-2").is_dir()
    assert Path(result["experiment"]).is_dir()  # Tune's storage, under the work dir
    math_history = json.loads((head_checkpoint(cfg, "eagle2", "math") / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in math_history] == [1, 2]
    finals = {p: p.stat().st_mtime_ns for p in heads.glob("*/final/model.safetensors")}
    assert len(finals) == 2

    again = run_training(cfg, log_line=lambda _: None)
    assert again["trained"] == [] and sorted(again["skipped"]) == ["eagle2-chat", "eagle2-math"]
    assert {p: p.stat().st_mtime_ns for p in heads.glob("*/final/model.safetensors")} == finals

    # one head lost after the experiment (e.g. trained on a node without the shared work dir): the rerun has
    # fewer heads to train, yet it is the same study, so it restores the same experiment instead of a new one
    shutil.rmtree(heads / "eagle2-chat" / "final")
    restored = run_training(cfg, log_line=lambda _: None)
    assert restored["experiment"] == result["experiment"] and restored["restored_experiment"]
    assert not result["restored_experiment"]
    assert restored["trained"] == ["eagle2-chat"] and restored["skipped"] == ["eagle2-math"] and not restored["failed"]
    assert head_finished(cfg, "eagle2", "chat")  # the final head came back from Tune's checkpoint
    assert [p.name for p in Path(result["experiment"]).parent.iterdir() if p.is_dir()] == [Path(result["experiment"]).name]


# --- cluster.yaml ----------------------------------------------------------------------------------------------


def test_cluster_yaml_is_a_valid_autoscaler_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    validate_config(config)  # Ray's own JSON schema (ray/autoscaler/ray-schema.json) + its extra checks
    validate_config(prepare_config(config))  # also after Ray fills in the AWS defaults, as `ray up` does
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["node_config"]["InstanceType"].startswith("m5.")
    assert any(t.get("resources", {}).get("GPU", 0) >= 1 for t in types.values())
    setup = " && ".join(config["setup_commands"])
    assert setup.index("torch==") < setup.index("constraints.txt -e") < setup.index("--no-deps -r")
    assert setup.count("-c /home/ray/taps-ray/constraints.txt") == 2  # torch and the project, both pinned
    ray_version = next(line.split("==")[1] for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("ray=="))
    image = config["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray_version}-py311-cu")  # a pinned image, the tested Ray, its CUDA
    cuda = image.rsplit("-", 1)[1]
    torch_line = next(c for c in config["setup_commands"] if "torch==" in c)
    assert torch_line.endswith(f"--index-url https://download.pytorch.org/whl/{cuda}"), "wheel and image disagree"
    assert "--gpus all" in config["docker"]["run_options"]  # else Ray schedules GPU actors on a GPU-less container
    assert any("torch.cuda.is_available()" in c for c in config["worker_setup_commands"])  # `ray up` stops early
    assert all(t["node_config"]["ImageId"].startswith(("ami-", "resolve:ssm:")) for t in types.values())
    commands = config["initialization_commands"] + config["setup_commands"]
    assert not any("|| true" in c for c in commands)  # a missing shared work dir stops `ray up`
    assert any(c.startswith("mountpoint -q /mnt/taps ||") and "exit 1" in c for c in config["initialization_commands"])
