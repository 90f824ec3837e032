"""Command functions for features, training and the heads report (wired into ``taps`` by taps_ray/cli.py).

Also runnable directly:

    python -m taps_ray.training.commands features --config configs/cpu.yaml [--mixture math]
    python -m taps_ray.training.commands train --config configs/cpu.yaml --kind hass --mixture math
    python -m taps_ray.training.commands report --config configs/cpu.yaml      # writes <reports_dir>/heads.md

``report`` trains whatever head of train.kinds × train.mixtures is missing (finished ones are reused, killed
ones resume), measures every head's held-out agreement with the target on math and chat, and writes the
report with the feature-extraction and training throughput.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from taps_ray.config import StudyConfig, load_config
from taps_ray.eval.store import atomic_write_text
from taps_ray.models.target import Target, load_target
from taps_ray.report.heads import write_heads_md
from taps_ray.training.agreement import DEFAULT_DOMAINS, cached_agreement
from taps_ray.training.features import extract_features
from taps_ray.training.trainer import METRICS_FILE, configure_threads, train_head

log = logging.getLogger(__name__)


def cmd_features(cfg: StudyConfig, mixture_name: str | None = None, target: Target | None = None) -> dict:
    """Extract (or reuse) the features of one mixture, or of every mixture in train.mixtures; returns stats."""
    configure_threads()
    names = [mixture_name] if mixture_name else list(dict.fromkeys(cfg.train.mixtures))
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


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cmd_agreement_report(cfg: StudyConfig, domains: Sequence[str] = DEFAULT_DOMAINS, output: str | Path | None = None) -> Path:
    """Train the missing heads of train.kinds × train.mixtures, evaluate each on the held-out `domains`, and
    write ``<reports_dir>/heads.md`` plus ``heads.json`` (the raw numbers)."""
    threads = configure_threads()
    started = time.time()
    load_before = _load_average()
    target = load_target(cfg.target)
    features = {}
    for name in dict.fromkeys([*cfg.train.mixtures, *domains]):
        fs = extract_features(cfg, name, target=target)
        features[name] = {k: v for k, v in fs.stats.items()}
    heads = []
    for mixture in cfg.train.mixtures:
        for kind in cfg.train.kinds:
            call_start = time.perf_counter()
            path = train_head(cfg, kind, mixture, target=target)
            call_s = time.perf_counter() - call_start
            state = json.loads((path / METRICS_FILE).read_text())
            agreement = cached_agreement(cfg, path, domains, target=target)
            heads.append({"kind": kind, "mixture": mixture, "path": str(path), "call_seconds": round(call_s, 1),
                          "state": {k: v for k, v in state.items() if k != "feature_stats"}, "agreement": agreement})
            print(f"{kind}-{mixture}: " + ", ".join(f"{d} {agreement[d]['acc']:.3f}" for d in domains))
    summary = {
        "config": cfg.name,
        "target": cfg.target.name,
        "dtype": cfg.target.dtype,
        "threads": threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "wall_seconds": round(time.time() - started, 1),
        "features": features,
        "heads": heads,
        "mixtures": {k: v.model_dump() for k, v in cfg.mixtures.items()},
        "features_config": cfg.features.model_dump(),
        "train_config": cfg.train.model_dump(),
    }
    folder = Path(output) if output else Path(cfg.reports_dir)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "heads.json", json.dumps(summary, indent=2))
    return write_heads_md(summary, folder, domains)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taps_ray.training.commands", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("features", "train", "report"):
        p = sub.add_parser(name)
        p.add_argument("--config", required=True)
        p.add_argument("--data-dir", default=None, help="local data directory (overrides the config's data_dir)")
        if name in ("features", "train"):
            p.add_argument("--mixture", default=None, required=name == "train")
        if name == "train":
            p.add_argument("--kind", choices=("eagle2", "hass"), required=True)
        if name == "report":
            p.add_argument("--output", default=None, help="folder for heads.md (default: the config's reports_dir)")
            p.add_argument("--render-only", action="store_true",
                           help="only re-render heads.md from the heads.json of an earlier run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    if args.data_dir:
        cfg = cfg.model_copy(update={"data_dir": args.data_dir})
    if args.command == "features":
        cmd_features(cfg, args.mixture)
    elif args.command == "train":
        cmd_train(cfg, args.kind, args.mixture)
    elif args.render_only:
        folder = Path(args.output) if args.output else Path(cfg.reports_dir)
        write_heads_md(json.loads((folder / "heads.json").read_text()), folder)
    else:
        cmd_agreement_report(cfg, output=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
