"""The whole study on Ray, resumable stage by stage: data -> features -> train -> eval -> report.

    python jobs/sweep.py --config configs/cpu.yaml [--quick] [--stages eval,report]
    ray job submit --working-dir . -- python jobs/sweep.py --config configs/paper.yaml   # on a cluster

* data      resolve every corpus and benchmark, build the training mixtures (counts -> <work_dir>/data.json)
* features  the missing feature sets, each one's missing shards over `features.num_workers` Ray tasks (target
            resources), every shard cached and atomic (`study.target_tasks`)
* train     Ray Tune, one trial per head kind x mixture (`study.tune`); finished heads are skipped; then one
            Ray task (target resources) measures the held-out agreement of heads not measured yet
* eval      every cell of the matrix not yet in the results store, through target workers and drafter
            actors (`study.eval_pool`); each cell is written atomically as it finishes, actor deaths are
            retried, a cell that keeps failing is recorded (failed.json) and the sweep goes on
* report    reads only: the study report from the results store (`report.build_report`) and the heads report
            from the heads' metrics and agreement (`report.heads.build_heads_report`)

Killing the driver at any point loses only the work in flight: a rerun skips finished feature shards,
finished heads (and resumes a head from its last epoch), and finished cells. `--quick` runs a shrunken
study (few conversations, one epoch, one question per benchmark, short answers) in `<work_dir>-quick`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taps_ray import workdir
from taps_ray.config import StudyConfig, load_config, with_overrides
from taps_ray.data.draft_vocab import draft_vocabulary
from taps_ray.data.mixtures import build_mixture
from taps_ray.data.sources import load_questions
from taps_ray.eval.cell import NO_HEAD
from taps_ray.eval.commands import plan_cells, refresh_summary, results_store
from taps_ray.eval.runner import eval_dtype
from taps_ray.fsio import atomic_write_json, atomic_write_text
from taps_ray.models.target import Target, load_tokenizer
from taps_ray.ray_runtime import start_ray
from taps_ray.report import build_report
from taps_ray.report.heads import build_heads_report
from taps_ray.study.actors import pack_heads
from taps_ray.study.eval_pool import EvalPool
from taps_ray.study.run_config import absolute_paths, log_line, quick_config, remote_env
from taps_ray.study.target_tasks import extract_feature_sets, on_target
from taps_ray.study.tune import run_training
from taps_ray.training.agreement import measure_agreement, unmeasured_heads
from taps_ray.training.features import MANIFEST, features_folder

STAGES = ("data", "features", "train", "eval", "report")


# --- stages --------------------------------------------------------------------------------------------------


def stage_data(cfg: StudyConfig, log: Callable[[str], None]) -> dict[str, Any]:
    data_dir = cfg.resolved_data_dir()
    summary: dict[str, Any] = {"mixtures": {}, "benchmarks": {}}
    for name in cfg.head_mixtures():
        conversations = build_mixture(cfg.mixtures[name], data_dir)
        summary["mixtures"][name] = len(conversations)
    for bench, limit in cfg.eval.benchmarks.items():
        summary["benchmarks"][bench] = len(load_questions(bench, data_dir, limit=limit))
    atomic_write_json(workdir.data_summary(cfg), summary)
    log(f"data: mixtures {summary['mixtures']}, benchmark questions {summary['benchmarks']}")
    return summary


def stage_features(cfg: StudyConfig, env: dict[str, str], log: Callable[[str], None]) -> dict[str, Any]:
    names = cfg.head_mixtures()
    missing = [n for n in names if not (features_folder(cfg, n) / MANIFEST).is_file()]
    if not missing:
        log(f"features: all {len(names)} feature sets cached; nothing to do")
        return {"extracted": [], "cached": names}
    log(f"features: extracting {missing} over {cfg.features.num_workers} task(s) "
        f"(cached: {[n for n in names if n not in missing]})")
    stats = extract_feature_sets(cfg, env, missing)
    for name, s in stats.items():
        log(f"features {name}: {s.get('conversations')} conversations, {s.get('tokens')} tokens, "
            f"{s.get('tokens_per_s', 0):.0f} tokens/s")
    return {"extracted": missing, "cached": [n for n in names if n not in missing], "stats": stats}


def stage_train(cfg: StudyConfig, env: dict[str, str], log: Callable[[str], None]) -> dict[str, Any]:
    """Train the missing heads with Tune, then measure the held-out agreement of the heads not measured yet
    (cached in each head's folder), so the report stage only reads."""
    out = run_training(cfg, env, log)
    todo = unmeasured_heads(cfg)
    if not todo:
        log("train: held-out agreement of every trained head already measured")
        return {**out, "agreement": {}}
    log(f"train: measuring held-out agreement of {todo}")
    agreement = on_target(cfg, env, measure_agreement)
    for label in todo:
        log(f"train: {label} held-out agreement " + ", ".join(f"{d} {acc:.3f}" for d, acc in agreement[label].items()))
    return {**out, "agreement": {label: agreement[label] for label in todo}}


def _prepare_draft_vocabulary(cfg: StudyConfig) -> None:
    """Build the shared reduced draft vocabulary once, here, instead of racing in every drafter."""
    tokenizer = load_tokenizer(cfg.target.name)
    stop_ids = Target(model=None, tokenizer=tokenizer, name=cfg.target.name).stop_token_ids
    draft_vocabulary(cfg, tokenizer, stop_ids)


def stage_eval(
    cfg: StudyConfig,
    env: dict[str, str],
    log: Callable[[str], None],
    on_cell_done: Callable | None = None,
    on_submit: Callable | None = None,
) -> dict[str, Any]:
    store = results_store(cfg)
    cells = plan_cells(cfg)
    todo = [c for c in cells if not store.is_done(c)]
    log(f"eval: {len(cells) - len(todo)} of {len(cells)} cells already in {store.root}; {len(todo)} to run")
    summary: dict[str, Any] = {"cells": len(cells), "skipped": len(cells) - len(todo), "done": [], "failed": []}
    if todo:
        kinds = sorted({c.head_kind for c in todo} - {NO_HEAD})
        heads = pack_heads(cfg, kinds)
        _prepare_draft_vocabulary(cfg)
        meta = {"target": cfg.target.name, "dtype": str(eval_dtype(cfg))}
        with EvalPool(cfg, heads, env) as pool:
            report = pool.run(todo, store, on_cell_done=on_cell_done, on_submit=on_submit, log_line=log, meta=meta)
        summary.update(done=report.done, failed=report.failed, retries=report.retries, worker_stats=report.worker_stats)
        log(f"eval: {len(report.done)} cells done, {len(report.failed)} failed, {report.retries} retries, "
            f"{report.seconds:.0f}s; worker batches {[s.get('batch_histogram') for s in report.worker_stats]}")
    refresh_summary(cfg, store)
    return summary


def stage_report(cfg: StudyConfig, log: Callable[[str], None], command: str | None = None) -> dict[str, Any]:
    """The study report from the results store, and the heads report from the heads' files; reads only."""
    path = build_report(cfg, command=command)
    log(f"report: {path}")
    heads = build_heads_report(cfg)
    log(f"report: {heads}")
    return {"path": str(path), "heads": str(heads)}


# --- the sweep -------------------------------------------------------------------------------------------------


def run_sweep(
    cfg: StudyConfig,
    quick: bool = False,
    stages: list[str] | tuple[str, ...] | None = None,
    *,
    on_cell_done: Callable | None = None,
    on_submit: Callable | None = None,
    log: Callable[[str], None] = log_line,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the study's stages in order on the current Ray (see `runtime.start_ray`); returns per-stage results."""
    import ray

    stages = list(stages or STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    if quick:
        cfg = quick_config(cfg)
    ran, cfg = cfg, absolute_paths(cfg)
    start_ray(cfg.ray)
    env = remote_env(cfg)
    log(f"config saved to {workdir.save_config(ran, workdir.study_config(cfg))} (give it to taps generate, serve or bench)")
    log(f"study {cfg.name}: stages {', '.join(stages)}; work dir {cfg.work_dir}; Ray {ray.cluster_resources()}")
    results: dict[str, Any] = {"config": cfg.name, "quick": quick, "stages": {}}
    sweep_start = time.perf_counter()
    for stage in STAGES:
        if stage not in stages:
            continue
        start = time.perf_counter()
        if stage == "data":
            out = stage_data(cfg, log)
        elif stage == "features":
            out = stage_features(cfg, env, log)
        elif stage == "train":
            out = stage_train(cfg, env, log)
        elif stage == "eval":
            out = stage_eval(cfg, env, log, on_cell_done=on_cell_done, on_submit=on_submit)
        else:
            out = stage_report(cfg, log, command)
        seconds = time.perf_counter() - start
        results["stages"][stage] = {"seconds": round(seconds, 1), **_jsonable(out)}
        log(f"stage {stage} finished in {seconds / 60:.1f} min")
    results["seconds"] = round(time.perf_counter() - sweep_start, 1)
    atomic_write_json(workdir.sweep_summary(cfg), results, default=str)
    log(f"sweep finished in {results['seconds'] / 60:.1f} min: "
        + ", ".join(f"{k} {v['seconds'] / 60:.1f} min" for k, v in results["stages"].items()))
    return results


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# --- `taps sweep` (and jobs/sweep.py, which calls it) ----------------------------------------------------------


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """The config with the flags applied (`taps sweep` also has the global --data-dir; jobs/sweep.py has not)."""
    return with_overrides(load_config(args.config), data_dir=getattr(args, "data_dir", None), work_dir=args.work_dir,
                          reports_dir=args.reports_dir)


def cmd_sweep(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
    start_ray(cfg.ray, args.address)
    command = f"python jobs/sweep.py --config {args.config}" + (" --quick" if args.quick else "")
    results = run_sweep(cfg, quick=args.quick, stages=stages, command=command)
    failed = results["stages"].get("eval", {}).get("failed", []) + results["stages"].get("train", {}).get("failed", [])
    return 1 if failed else 0

