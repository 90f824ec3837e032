"""The whole study on Ray, resumable stage by stage: data -> features -> train -> eval -> report.

    python jobs/sweep.py --config configs/cpu.yaml [--quick] [--stages eval,report]
    ray job submit --working-dir . -- python jobs/sweep.py --config configs/paper.yaml   # on a cluster

* data      resolve every corpus and benchmark, build the training mixtures (counts -> <work_dir>/data.json)
* features  one Ray task (target resources) extracts the missing feature sets (cached, sharded, atomic)
* train     Ray Tune, one trial per head kind x mixture (`cluster.tune`); finished heads are skipped
* eval      every cell of the matrix not yet in the results store, through target workers and drafter
            actors (`cluster.pool`); each cell is written atomically as it finishes, actor deaths are
            retried, a cell that keeps failing is recorded (failed.json) and the sweep goes on
* report    `taps_ray.report.build_report(cfg)` when that module is installed

Killing the driver at any point loses only the work in flight: a rerun skips finished feature shards,
finished heads (and resumes a head from its last epoch), and finished cells. `--quick` runs a shrunken
study (few conversations, one epoch, one question per benchmark, short answers) in `<work_dir>-quick`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taps_ray.config import StudyConfig, load_config

STAGES = ("data", "features", "train", "eval", "report")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's single-machine mode, everything on 127.0.0.1
QUICK_COMBINATIONS = ("confidence-routed", "merged")


def log_line(message: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- configuration -----------------------------------------------------------------------------------------


def quick_config(cfg: StudyConfig) -> StudyConfig:
    """A few-minutes version of the study: same shape, tiny budgets, its own work dir."""
    mixtures = {name: m.model_copy(update={"size": min(m.size, 32)}) for name, m in cfg.mixtures.items()}
    train_mixtures = cfg.train.mixtures[:2]
    train = cfg.train.model_copy(
        update={
            "kinds": cfg.train.kinds[:1],
            "mixtures": train_mixtures,
            "epochs": 1,
            "max_tokens": min(cfg.train.max_tokens or 8192, 8192),
        }
    )
    features = cfg.features.model_copy(update={"max_len": min(cfg.features.max_len, 256)})
    proposers = [p for p in cfg.eval.proposers if p in train_mixtures]
    if len(train_mixtures) >= 2:
        proposers += [p for p in QUICK_COMBINATIONS if p in cfg.eval.proposers]
    evaluation = cfg.eval.model_copy(
        update={
            "benchmarks": {b: 1 for b in cfg.eval.benchmarks},
            "max_new_tokens": min(cfg.eval.max_new_tokens, 32),
            "proposers": proposers or train_mixtures[:1],
        }
    )
    work_dir = cfg.work_dir.rstrip("/") + "-quick"
    return cfg.model_copy(
        update={
            "name": f"{cfg.name}-quick",
            "mixtures": mixtures,
            "train": train,
            "features": features,
            "eval": evaluation,
            "work_dir": work_dir,
            "reports_dir": str(Path(work_dir) / "reports"),
        }
    )


def absolute_paths(cfg: StudyConfig) -> StudyConfig:
    """Actors and Tune trials run in other working directories: give them absolute paths."""
    data_dir = cfg.resolved_data_dir()
    return cfg.model_copy(
        update={
            "work_dir": str(Path(cfg.work_dir).expanduser().resolve()),
            "reports_dir": str(Path(cfg.reports_dir).expanduser().resolve()),
            "data_dir": str(data_dir.resolve()) if data_dir else None,
        }
    )


def remote_env(cfg: StudyConfig) -> dict[str, str]:
    from taps_ray.cluster.actors import runtime_env_vars

    env = runtime_env_vars()
    if cfg.data_dir:
        env["TAPS_DATA_DIR"] = cfg.data_dir
    return env


def init_ray(cfg: StudyConfig, address: str | None = None) -> None:
    """Join a cluster when an address is given (or RAY_ADDRESS is set, as under `ray job submit`);
    otherwise start a local Ray on loopback with the config's CPUs."""
    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:
        # A single-machine Ray: Ray then takes 127.0.0.1 as the node address, and every listener (GCS, raylet,
        # workers, agents) binds to loopback; `_node_ip_address` alone leaves the gRPC ports on 0.0.0.0.
        os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by a local Ray's workers (Tune trials too)
    if address:
        ray.init(address=address)
    else:
        if os.environ.get(LOOPBACK_ENV) == "0":
            from ray._private import ray_constants  # read when ray was first imported: it may predate us

            ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")


# --- stages --------------------------------------------------------------------------------------------------


def stage_data(cfg: StudyConfig, log: Callable[[str], None]) -> dict[str, Any]:
    from taps_ray.data.mixtures import build_mixture
    from taps_ray.data.sources import load_questions
    from taps_ray.eval.store import atomic_write_text

    data_dir = cfg.resolved_data_dir()
    summary: dict[str, Any] = {"mixtures": {}, "benchmarks": {}}
    for name in dict.fromkeys(cfg.train.mixtures):
        conversations = build_mixture(cfg.mixtures[name], data_dir)
        summary["mixtures"][name] = len(conversations)
    for bench, limit in cfg.eval.benchmarks.items():
        summary["benchmarks"][bench] = len(load_questions(bench, data_dir, limit=limit))
    atomic_write_text(cfg.work_path("data.json"), json.dumps(summary, indent=2))
    log(f"data: mixtures {summary['mixtures']}, benchmark questions {summary['benchmarks']}")
    return summary


def _features_remote():
    import ray

    @ray.remote
    def extract(payload: str, names: list[str], env: dict[str, str]) -> dict:
        from taps_ray.cluster.actors import prepare_process
        from taps_ray.config import parse_config
        from taps_ray.models.target import load_target
        from taps_ray.training.features import extract_features

        cfg = parse_config(json.loads(payload), "<driver>")
        threads = prepare_process(env, cfg.ray.torch_threads, cfg.ray.target_num_cpus)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        target = load_target(cfg.target)
        out = {}
        for name in names:
            features = extract_features(cfg, name, target=target, progress=False)
            out[name] = {k: v for k, v in features.stats.items() if isinstance(v, (int, float, str, bool))}
        return out

    return extract


def stage_features(cfg: StudyConfig, env: dict[str, str], log: Callable[[str], None]) -> dict[str, Any]:
    import ray

    from taps_ray.training.features import MANIFEST, features_folder

    names = list(dict.fromkeys(cfg.train.mixtures))
    missing = [n for n in names if not (features_folder(cfg, n) / MANIFEST).is_file()]
    if not missing:
        log(f"features: all {len(names)} feature sets cached; nothing to do")
        return {"extracted": [], "cached": names}
    log(f"features: extracting {missing} (cached: {[n for n in names if n not in missing]})")
    from taps_ray.cluster.actors import process_runtime_env

    task = _features_remote().options(
        num_cpus=cfg.ray.target_num_cpus, num_gpus=cfg.ray.target_num_gpus, resources=cfg.ray.target_resources,
        runtime_env=process_runtime_env(),
    )
    stats = ray.get(task.remote(cfg.model_dump_json(), missing, env))
    for name, s in stats.items():
        log(f"features {name}: {s.get('conversations')} conversations, {s.get('tokens')} tokens, "
            f"{s.get('tokens_per_s', 0):.0f} tokens/s")
    return {"extracted": missing, "cached": [n for n in names if n not in missing], "stats": stats}


def stage_train(cfg: StudyConfig, env: dict[str, str], log: Callable[[str], None]) -> dict[str, Any]:
    from taps_ray.cluster.tune import run_training

    return run_training(cfg, env, log)


def _prepare_draft_vocabulary(cfg: StudyConfig) -> None:
    """Build the shared reduced draft vocabulary once, here, instead of racing in every drafter."""
    if getattr(cfg.tree, "draft_vocab_size", None) is None:
        return
    try:
        from taps_ray.spec.draft_vocab import draft_vocabulary
    except ImportError:
        return
    from taps_ray.models.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.target.name)
    from taps_ray.models.target import Target

    stop_ids = Target(model=None, tokenizer=tokenizer, name=cfg.target.name).stop_token_ids
    draft_vocabulary(cfg, tokenizer, stop_ids)


def stage_eval(
    cfg: StudyConfig,
    env: dict[str, str],
    log: Callable[[str], None],
    on_cell_done: Callable | None = None,
    on_submit: Callable | None = None,
) -> dict[str, Any]:
    from taps_ray.cluster.actors import pack_heads
    from taps_ray.cluster.pool import EvalPool
    from taps_ray.eval.commands import NO_HEAD, plan_cells, refresh_summary, results_store
    from taps_ray.eval.runner import eval_dtype

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
    """The study report from the results store, and the heads report (held-out agreement, cached per head)."""
    from taps_ray.report import build_report
    from taps_ray.training.commands import cmd_agreement_report

    path = build_report(cfg, command=command)
    log(f"report: {path}")
    heads = cmd_agreement_report(cfg)
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
    """Run the study's stages in order on the current Ray (see `init_ray`); returns per-stage results."""
    import ray

    stages = list(stages or STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    if quick:
        cfg = quick_config(cfg)
    cfg = absolute_paths(cfg)
    if not ray.is_initialized():
        init_ray(cfg)
    env = remote_env(cfg)
    cfg.work_path().mkdir(parents=True, exist_ok=True)
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
    from taps_ray.eval.store import atomic_write_text

    atomic_write_text(cfg.work_path("sweep.json"), json.dumps(results, indent=2, default=str))
    log(f"sweep finished in {results['seconds'] / 60:.1f} min: "
        + ", ".join(f"{k} {v['seconds'] / 60:.1f} min" for k, v in results["stages"].items()))
    return results


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# --- command line (jobs/sweep.py and `taps sweep`) ----------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="study config, e.g. configs/cpu.yaml")
    parser.add_argument("--quick", action="store_true", help="a shrunken study that finishes in minutes (own work dir)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--address", default=None, help="Ray address (default: ray.address of the config; 'auto' joins)")
    parser.add_argument("--work-dir", default=None, help="override work_dir (use an absolute path on a cluster)")
    parser.add_argument("--reports-dir", default=None, help="override reports_dir")


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    cfg = load_config(args.config)
    update = {}
    if args.work_dir:
        update["work_dir"] = args.work_dir
    if args.reports_dir:
        update["reports_dir"] = args.reports_dir
    return cfg.model_copy(update=update) if update else cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jobs/sweep.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return cmd_sweep(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    init_ray(cfg, args.address)
    command = f"python jobs/sweep.py --config {args.config}" + (" --quick" if args.quick else "")
    results = run_sweep(cfg, quick=args.quick, stages=stages, command=command)
    failed = results["stages"].get("eval", {}).get("failed", []) + results["stages"].get("train", {}).get("failed", [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
