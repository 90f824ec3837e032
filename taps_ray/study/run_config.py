"""The study's configuration for a run on Ray, shared by the sweep and the mixture search: the quick variant, the
absolute paths actors need, the environment remote tasks get, and the log line both print.
"""

from __future__ import annotations

import time
from pathlib import Path

from taps_ray.config import DATA_DIR_ENV, StudyConfig
from taps_ray.ray_runtime import runtime_env_vars

QUICK_COMBINATIONS = ("confidence-routed", "merged")


def log_line(message: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {message}", flush=True)


def quick_config(cfg: StudyConfig) -> StudyConfig:
    """A few-minutes version of the study: same shape, tiny budgets, its own work dir."""
    mixtures = {name: m.model_copy(update={"size": min(m.size, 32)}) for name, m in cfg.mixtures.items()}
    train_mixtures = cfg.train.mixtures[:2]
    train = cfg.train.model_copy(
        update={
            "kinds": cfg.train.kinds[:1],
            "mixtures": train_mixtures,
            "compare": {},
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
            "live_proposers": None,
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
    env = runtime_env_vars()
    if cfg.data_dir:
        env[DATA_DIR_ENV] = cfg.data_dir
    return env
