"""The training stage on Ray Tune: one trial per (head kind × mixture), each running the trainer.

Resources per trial come from the config (`ray.trial_cpus`, `ray.trial_gpus`, `ray.trial_memory_gb`,
`ray.trial_resources`: `ray_requests.tune_trial`, via `tune.with_resources`).
The trainer's per-epoch `report(metrics)` callback becomes `tune.report(metrics, checkpoint=<that epoch's
folder>)`, and a last report carries the `final` head.

Resuming happens at three levels, cheapest first:

1. finished heads are skipped before Tune starts (their `final` checkpoint exists and was trained with
   today's settings — the trainer's run fingerprint);
2. the experiment is the study's, one trial per head (its name comes from the config name, head kinds,
   mixtures and every head's settings, not from the heads still to train), so a rerun after an interruption
   finds it and restores it with `Tuner.restore` from its storage (`ray.storage_path`, default
   `<work_dir>/tune`, or s3://... on a cluster): finished trials stay finished, the others restart; a trial
   whose head was already trained only reports it;
3. a restarted trial continues from the trainer's own newest epoch checkpoint in the work dir; on a
   cluster without a shared work dir it first copies Tune's last checkpoint of the trial back into it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from taps_ray import ray_requests
from taps_ray.config import StudyConfig, parse_config
from taps_ray.fsio import atomic_dir
from taps_ray.training import trainer
from taps_ray.training.features import features_key
from taps_ray.workdir import FINAL, epoch_checkpoint, head_checkpoint, head_dir, tune_dir

log = logging.getLogger(__name__)

EXPERIMENT_PREFIX = "train"


def head_pairs(cfg: StudyConfig) -> list[tuple[str, str]]:
    return cfg.head_pairs()


def expected_fingerprint(cfg: StudyConfig, kind: str, mixture: str) -> str:
    return trainer.run_fingerprint(cfg, kind, SimpleNamespace(key=features_key(cfg, mixture)))


def head_finished(cfg: StudyConfig, kind: str, mixture: str) -> bool:
    """The head's `final` checkpoint exists and was trained with the current settings."""
    final = head_checkpoint(cfg, kind, mixture)
    try:
        metrics = json.loads((final / trainer.METRICS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (final / "model.safetensors").is_file() and metrics.get("fingerprint") == expected_fingerprint(cfg, kind, mixture)


def numeric_metrics(metrics: dict) -> dict[str, float]:
    """The numbers of a metrics dict: what `tune.report` takes."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _copy_in(source: Path, target: Path) -> None:
    """Copy a checkpoint folder into place atomically (a folder that exists is complete)."""
    if target.exists():
        return
    with atomic_dir(target, replace=False) as staging:  # someone else may put it there first: theirs wins
        shutil.copytree(source, staging, dirs_exist_ok=True)


def restore_checkpoint(cfg: StudyConfig, kind: str, mixture: str, folder: Path) -> str | None:
    """Put a Tune checkpoint of this head (an epoch or the final head) back into the work dir if missing."""
    heads = head_dir(cfg, kind, mixture)
    if (folder / trainer.STATE_FILE).is_file():
        epoch = json.loads((folder / trainer.STATE_FILE).read_text()).get("epoch")
        target = epoch_checkpoint(heads, epoch)
    elif (folder / trainer.METRICS_FILE).is_file():
        target = heads / FINAL
    else:
        return None
    if target.exists():
        return None
    _copy_in(folder, target)
    return target.name


def _trial(config: dict, study: str = "", env: dict | None = None) -> None:
    """One Tune trial: train (or resume) one head, reporting every epoch with its checkpoint."""
    from ray import tune

    os.environ.update(env or {})
    cfg = parse_config(json.loads(study), "<tune trial>")
    kind, mixture = config["head"]
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            restored = restore_checkpoint(cfg, kind, mixture, Path(folder))
            if restored:
                log.info("%s-%s: restored %s from Tune's checkpoint", kind, mixture, restored)
    epochs_reported = []

    def report(metrics: dict) -> None:
        epochs_reported.append(metrics.get("epoch"))
        tune.report(numeric_metrics(metrics), checkpoint=tune.Checkpoint.from_directory(metrics["checkpoint"]))

    if head_finished(cfg, kind, mixture):  # trained before this experiment: only report it
        final = head_checkpoint(cfg, kind, mixture)
    else:
        final = trainer.train_head(cfg, kind, mixture, report=report, progress=False)
    state = json.loads((final / trainer.METRICS_FILE).read_text())
    last = state["history"][-1] if state.get("history") else {}
    tune.report(
        {**numeric_metrics(last), "final": 1, "epochs_this_run": len(epochs_reported)},
        checkpoint=tune.Checkpoint.from_directory(str(final)),
    )


def experiment_name(cfg: StudyConfig) -> str:
    """The study's experiment: config name, head kinds, mixtures and a digest of every head's settings.

    It does not depend on which heads are still to train, so a rerun after some heads finished finds the
    same experiment and restores it; changed settings name a new one.
    """
    fingerprints = [(k, m, expected_fingerprint(cfg, k, m)) for k, m in head_pairs(cfg)]
    digest = hashlib.sha256(json.dumps(fingerprints).encode()).hexdigest()[:10]
    label = "-".join([cfg.name, "+".join(cfg.train.kinds), "+".join(dict.fromkeys(cfg.train.mixtures))])
    return f"{EXPERIMENT_PREFIX}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', label)}-{digest}"


def storage_path(cfg: StudyConfig) -> str:
    if cfg.ray.storage_path:
        return cfg.ray.storage_path
    return str(tune_dir(cfg).resolve())


def open_experiment(cfg: StudyConfig, name: str, trainable: Callable, param_space: dict,
                    tune_config: Any) -> tuple[Any, str, bool]:
    """(Tuner, experiment path, restored): the experiment `name` in the study's Tune storage, restored with
    `Tuner.restore` when an interrupted run left it there (finished trials stay finished, the others resume),
    else a new one. Each trial gets the `ray.trial_*` resources and keeps its newest checkpoint."""
    from ray import tune

    storage = storage_path(cfg)
    path = f"{storage.rstrip('/')}/{name}"
    if "://" not in storage:
        Path(storage).mkdir(parents=True, exist_ok=True)
    trainable = tune.with_resources(trainable, tune.PlacementGroupFactory([ray_requests.tune_trial(cfg).bundle()]))
    if tune.Tuner.can_restore(path):
        tuner = tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=True, param_space=param_space)
        return tuner, path, True
    run_config = tune.RunConfig(
        name=name,
        storage_path=storage,
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
        failure_config=tune.FailureConfig(max_failures=cfg.ray.max_trial_failures),
        verbose=1,
    )
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config), path, False


def run_training(
    cfg: StudyConfig, env: dict[str, str] | None = None, log_line: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train every missing head of train.kinds × train.mixtures and train.compare with Ray Tune; returns what happened."""
    from ray import tune

    pairs = head_pairs(cfg)
    todo = [p for p in pairs if not head_finished(cfg, *p)]
    summary: dict[str, Any] = {"heads": len(pairs), "skipped": [f"{k}-{m}" for k, m in pairs if (k, m) not in todo]}
    if not todo:
        log_line(f"train: all {len(pairs)} heads already trained; nothing to do")
        return {**summary, "trained": [], "failed": [], "restored_experiment": False, "seconds": 0.0}
    start = time.perf_counter()
    param_space = {"head": tune.grid_search([list(p) for p in pairs])}  # the whole study: restorable as is
    tune_config = tune.TuneConfig(trial_name_creator=_trial_name, trial_dirname_creator=_trial_name,
                                  max_concurrent_trials=None)
    trainable = tune.with_parameters(_trial, study=cfg.model_dump_json(), env=env or {})
    tuner, path, restored = open_experiment(cfg, experiment_name(cfg), trainable, param_space, tune_config)
    if restored:
        log_line(f"train: restoring the interrupted Tune experiment {path}")
    else:
        log_line(f"train: {len(pairs)} trials, {len(todo)} to train ({', '.join(f'{k}-{m}' for k, m in todo)}) -> {path}")
    results = tuner.fit()
    trained, failed = [], []
    for result in results:
        kind, mixture = result.config["head"]
        label = f"{kind}-{mixture}"
        if result.error is not None:
            failed.append(label)
            log_line(f"train: {label} FAILED: {str(result.error)[:300]}")
            continue
        if (kind, mixture) not in todo:  # finished before this run: listed under skipped
            continue
        if not head_finished(cfg, kind, mixture) and result.checkpoint is not None:
            with result.checkpoint.as_directory() as folder:  # a trial on another node without shared disk
                restore_checkpoint(cfg, kind, mixture, Path(folder))
        if head_finished(cfg, kind, mixture):
            trained.append(label)
            metrics = result.metrics or {}
            log_line(
                f"train: {label} done (held-out agreement {metrics.get('heldout_acc', float('nan')):.3f}, "
                f"{metrics.get('epochs_this_run', '?')} epoch(s) this run) -> {head_checkpoint(cfg, kind, mixture)}"
            )
        else:
            failed.append(label)
            log_line(f"train: {label} finished without a usable final head")
    return {
        **summary,
        "trained": trained,
        "failed": failed,
        "experiment": path,
        "restored_experiment": restored,
        "seconds": time.perf_counter() - start,
    }


def _trial_name(trial) -> str:
    kind, mixture = trial.config["head"]
    return f"{kind}-{mixture}-{trial.trial_id}"
