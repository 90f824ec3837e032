#!/usr/bin/env python
"""Memory bounded by design, measured: writes reports/memory.md. Not a test.

    python benchmarks/memory/memory.py --config configs/cpu.yaml

1. Actors: a loopback Ray (`runtime.start_ray`), the config's `EvalPool` with one target worker and one drafter;
   each actor reports its own memory (`memory()`: RSS, USS, PSS, psutil) once both are ready, and again after
   the pool has evaluated one cell (plain decoding of one question, so no heads are needed).
2. Training: `train_head` in a fresh subprocess per corpus size (peak RSS = `ru_maxrss` of that subprocess) on
   synthetic feature shards at the config target's width, 1x and 4x the conversations; one epoch over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from taps_ray.config import StudyConfig, load_config  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402

MB = 2**20
TRAIN_CONFIG = "configs/tiny.yaml"
BASE_CONVERSATIONS = 400  # 1x; each of SEQ_LEN tokens
SEQ_LEN = 512


CELL_QUESTIONS = 1  # the evaluated cell: plain decoding of this many questions of the config's first benchmark


def floor_memory(name: str) -> dict[str, int]:
    """What every actor holds besides weights: the actor modules (torch, transformers, Ray) and the tokenizer."""
    import taps_ray.study.actors as actors
    import taps_ray.eval.runner  # noqa: F401  (a drafter imports it for its first cell)
    from taps_ray.models.target import load_tokenizer

    load_tokenizer(name)
    return actors.memory_use()


def actor_memory(cfg: StudyConfig) -> dict[str, dict[str, int]]:
    """Memory (`memory_use`) of one target worker and one drafter of `cfg`, idle after loading and after one
    evaluated cell, and of the floor."""
    import ray

    from taps_ray.eval.cell import NO_HEAD, PLAIN, Cell
    from taps_ray.eval.store import ResultsStore
    from taps_ray.ray_runtime import process_runtime_env, start_ray
    from taps_ray.study.eval_pool import EvalPool

    one = cfg.ray.model_copy(update={"num_target_workers": 1, "num_drafters": 1, "address": None})
    benchmark = next(iter(cfg.eval.benchmarks))
    evaluation = cfg.eval.model_copy(update={"benchmarks": {benchmark: CELL_QUESTIONS}})
    cfg = cfg.model_copy(update={"ray": one, "eval": evaluation})
    owned = start_ray(cfg.ray, log_to_driver=False)
    try:
        with EvalPool(cfg) as pool, tempfile.TemporaryDirectory(prefix="taps-memory-") as results:
            pool.ready(timeout=900)
            actors = [pool.workers[0], pool.drafters[0]]
            worker, drafter = ray.get([a.memory.remote() for a in actors])
            report = pool.run([Cell(NO_HEAD, PLAIN, benchmark, 0.0)], ResultsStore(results), log_line=lambda _: None)
            assert report.done and not report.failed, report
            worker_cell, drafter_cell = ray.get([a.memory.remote() for a in actors])
        floor = ray.get(ray.remote(floor_memory).options(num_cpus=0, runtime_env=process_runtime_env()).remote(cfg.target.name))
    finally:
        if owned:
            ray.shutdown()
    return {"target_worker": worker, "drafter": drafter, "floor": floor,
            "target_worker_cell": worker_cell, "drafter_cell": drafter_cell, "cell": f"{benchmark}, {PLAIN}, T = 0"}


def actors_section(cfg: StudyConfig, mem: dict[str, dict[str, int]]) -> list[str]:
    worker, drafter, floor = mem["target_worker"], mem["drafter"], mem["floor"]
    worker_cell, drafter_cell = mem["target_worker_cell"], mem["drafter_cell"]

    def row(label: str, m: dict[str, int]) -> str:
        return f"| {label} | {m['rss'] / MB:.0f} | {m['uss'] / MB:.0f} | {m['pss'] / MB:.0f} |"

    rss, uss = drafter["rss"] / worker["rss"], drafter["uss"] / worker["uss"]
    rss_cell, uss_cell = drafter_cell["rss"] / worker_cell["rss"], drafter_cell["uss"] / worker_cell["uss"]
    above = (drafter["rss"] - floor["rss"]) / (worker["rss"] - floor["rss"])
    verdict = "meets" if rss < 0.5 else "misses"
    return [
        "## Drafter vs target worker",
        "",
        f"Target `{cfg.target.name}`, dtype `{cfg.eval.dtype or cfg.target.dtype}`; each actor's memory right after "
        "loading (psutil `memory_full_info`, read inside the actor). RSS counts every resident page a process "
        "maps, shared library text included; USS counts the pages only that process holds (what ending it "
        "frees); PSS splits each shared page among the processes mapping it, so it moves with whatever else "
        "runs on the machine.",
        "",
        "| actor | RSS (MB) | USS (MB) | PSS (MB) |",
        "|---|---:|---:|---:|",
        row("TargetWorker (whole target, verification pool)", worker),
        row("DrafterActor (embeddings + LM head mapped, `models/draft_parts.py`)", drafter),
        row("floor: a Ray task with the actors' imports and the tokenizer, no weights", floor),
        row(f"TargetWorker after one cell ({mem['cell']}, {CELL_QUESTIONS} question)", worker_cell),
        row("DrafterActor after the same cell", drafter_cell),
        "",
        "The goal's measure is RSS, as this report measured it when the goal was set: drafter / target worker = "
        f"**{rss:.2f}**, so the drafter {verdict} \"less than half a target worker's memory\" on this target; above the floor: "
        f"**{above:.2f}**. By USS (what each actor adds on a node where every Ray worker already maps the same "
        f"torch libraries) the ratio is **{uss:.2f}**. After one evaluated cell, RSS **{rss_cell:.2f}** and USS "
        f"**{uss_cell:.2f}**. The drafter imports no transformers model code, no Auto classes and no pandas "
        "(tests/test_heads_blocks.py: `run_cell` returns plain records, the driver's `ResultsStore` makes the "
        "frames), builds its tokenizer from the tokenizer files (`models.target.plain_fast_tokenizer`, the "
        "same ids as AutoTokenizer: tests/test_tokenizer.py) "
        "and maps only `model.embed_tokens.weight` (and `lm_head.weight` when "
        "untied) from the target's safetensors: on the CPU it reads, cast to its dtype, the rows an embedding "
        "lookup needs and keeps resident only the LM head's draft-vocabulary rows (the whole head when it drafts "
        "over the full vocabulary), so idle, and after a plain cell, it holds no weights; at 135M parameters "
        "Python, torch, Ray's worker and the tokenizer are most of both processes. What the drafter saves is the layers: at 8B its weights are 2.10 GB against "
        "the worker's 16.06 GB (docs/paper_plan.md).",
        "",
    ]


def train_config(work_dir: str, conversations: int) -> StudyConfig:
    """The tiny target, one synthetic mixture of `conversations`, one eagle2 epoch over all of it."""
    cfg = load_config(TRAIN_CONFIG)
    mixture = cfg.mixtures["math"].model_copy(update={"size": conversations})
    return cfg.model_copy(deep=True, update={
        "work_dir": work_dir,
        "mixtures": {"bench": mixture},
        "features": cfg.features.model_copy(update={"max_len": SEQ_LEN}),
        "train": cfg.train.model_copy(update={"kinds": ["eagle2"], "mixtures": ["bench"], "epochs": 1,
                                                "batch_size": 16, "hca_passes": 1}),
        "tree": cfg.tree.model_copy(update={"draft_vocab_size": 512}),
    })


def write_synthetic_features(cfg: StudyConfig) -> int:
    """Random features at the target's width in the feature cache (shards + manifest); returns stored bytes."""
    import torch

    from taps_ray.fsio import atomic_write_json
    from taps_ray.models.target import load_target
    from taps_ray.training.features import MANIFEST, Example, feature_spec, features_folder, write_shard

    target = load_target(cfg.target)
    d, k, vocab = target.model.config.hidden_size, cfg.features.top_k, len(target.tokenizer)
    folder = features_folder(cfg, "bench")
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    size, n, shards = cfg.features.shard_size, cfg.mixtures["bench"].size, []
    for index, first in enumerate(range(0, n, size)):
        examples = [Example(
            id=f"synthetic-{i}",
            input_ids=torch.randint(0, vocab, (SEQ_LEN,), generator=generator),
            loss_mask=torch.ones(SEQ_LEN),
            hidden=torch.randn(SEQ_LEN, d, generator=generator),
            topk_probs=torch.rand(SEQ_LEN, k, generator=generator).sort(-1, descending=True).values / k,
            topk_ids=torch.randint(0, vocab, (SEQ_LEN, k), generator=generator),
        ) for i in range(first, min(n, first + size))]
        name = f"shard-{index:05d}.safetensors"
        write_shard(folder / name, examples, {"tokens": SEQ_LEN * len(examples)})
        shards.append({"file": name, "ids": [e.id for e in examples], "digests": [], "tokens": SEQ_LEN * len(examples)})
    atomic_write_json(folder / MANIFEST, {"key": folder.name, "spec": feature_spec(cfg, "bench"), "shards": shards,
                                          "stats": {"conversations": n, "tokens": n * SEQ_LEN}})
    return sum(p.stat().st_size for p in folder.glob("shard-*"))


def measure_once(work_dir: str, conversations: int, mode: str) -> None:
    """In a fresh process: `load` (every feature in memory, as training did before streaming) or `train`."""
    from taps_ray.training.features import extract_features
    from taps_ray.training.trainer import train_head

    cfg = train_config(work_dir, conversations)
    if mode == "load":
        examples = extract_features(cfg, "bench", progress=False).load()
        sum(float(e.hidden.float().sum() + e.topk_probs.float().sum()) for e in examples)  # resident, as training reads them
    else:
        train_head(cfg, "eagle2", "bench", progress=False)
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def train_rss(scale: int) -> dict[str, int]:
    """Peak RSS of `load` and of `train`, each in its own subprocess, at `scale` times the base corpus."""
    n = BASE_CONVERSATIONS * scale
    with tempfile.TemporaryDirectory(prefix="taps-memory-") as work_dir:
        out = {"features_bytes": write_synthetic_features(train_config(work_dir, n)), "tokens": n * SEQ_LEN}
        for mode in ("load", "train"):
            run = subprocess.run([sys.executable, __file__, "--measure", work_dir, str(n), mode],
                                 check=True, capture_output=True, text=True)
            out[mode] = json.loads(run.stdout.strip().splitlines()[-1])["peak_rss"]
    return out


def training_section(results: dict[int, dict[str, int]]) -> list[str]:
    cfg = train_config("", BASE_CONVERSATIONS)
    lines = [
        "## Training memory vs corpus size",
        "",
        f"`{cfg.target.name}` ({TRAIN_CONFIG}) with synthetic feature shards (random, stored exactly as extraction "
        f"stores them) of {SEQ_LEN}-token conversations, {cfg.features.shard_size} per shard; one eagle2 epoch over "
        f"every conversation, `train.shuffle_shards` = {cfg.train.shuffle_shards}. Peak RSS = `ru_maxrss` of a fresh "
        "subprocess per run. `load` is what training held before streaming: every feature in memory "
        "(`FeatureSet.load()`, every tensor read once); `train` is `train_head` now, which pins glibc's mmap "
        "threshold (`training/malloc.py`) so that each freed window of shards goes back to the OS.",
        "",
        "| corpus | conversations | tokens | features on disk (MB) | peak RSS, load all (MB) | peak RSS, train (MB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for scale, r in sorted(results.items()):
        lines.append(f"| {scale}x | {BASE_CONVERSATIONS * scale} | {r['tokens']:,} | {r['features_bytes'] / MB:.0f} | "
                     f"{r['load'] / MB:.0f} | {r['train'] / MB:.0f} |")
    grow = results[4]["train"] - results[1]["train"]
    lines += ["", f"Training's peak grows by {grow / MB:.0f} MB from 1x to 4x, while the features grow by "
              f"{(results[4]['features_bytes'] - results[1]['features_bytes']) / MB:.0f} MB.", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--out", default="reports/memory.md")
    parser.add_argument("--measure", nargs=3, metavar=("WORK_DIR", "N", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure_once(args.measure[0], int(args.measure[1]), args.measure[2])
        return
    cfg = load_config(args.config)
    memory = actor_memory(cfg)
    trained = {scale: train_rss(scale) for scale in (1, 4)}
    lines = [
        "# Memory",
        "",
        f"Regenerate: `python benchmarks/memory/memory.py {shlex.join(sys.argv[1:])}`",
        f"{cpu_line()}.",
        "",
        *actors_section(cfg, memory),
        *training_section(trained),
    ]
    report_lines(lines, args.out)


if __name__ == "__main__":
    main()
