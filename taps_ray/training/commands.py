"""Command functions for features, training and held-out agreement; `taps features|train|agreement` (cli.py)
parse the arguments and call them."""

from __future__ import annotations

import json
from pathlib import Path

from taps_ray.config import StudyConfig
from taps_ray.models.target import Target, load_target
from taps_ray.training.agreement import measure_agreement
from taps_ray.training.features import extract_features
from taps_ray.training.trainer import configure_threads, train_head


def cmd_features(cfg: StudyConfig, mixture_name: str | None = None, target: Target | None = None) -> dict:
    """Extract (or reuse) the features of one mixture, or of every mixture a head trains on; returns stats."""
    configure_threads()
    names = [mixture_name] if mixture_name else cfg.head_mixtures()
    target = target or load_target(cfg.target)
    out = {}
    for name in names:
        features = extract_features(cfg, name, target=target)
        out[name] = {"folder": str(features.folder), **features.stats}
        print(f"features {name}: {json.dumps(out[name])}")
    return out


def cmd_train(cfg: StudyConfig, kind: str, mixture_name: str, target: Target | None = None) -> Path:
    """Train (or resume) one head; prints per-epoch metrics and returns the final checkpoint folder."""
    path = train_head(cfg, kind, mixture_name, report=lambda m: print(json.dumps(m)), target=target)
    print(f"head {kind}-{mixture_name}: {path}")
    return path


def cmd_agreement(cfg: StudyConfig) -> dict[str, dict[str, float | None]]:
    """Measure (or reuse) the held-out agreement of every trained head, for the heads report to read."""
    configure_threads()
    measured = measure_agreement(cfg)
    for label, accuracy in measured.items():
        print(f"{label}: " + ", ".join(f"{d} {acc:.3f}" for d, acc in accuracy.items()))
    return measured
