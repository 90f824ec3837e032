"""Command functions for features, training and held-out agreement (wired into ``taps`` by taps_ray/cli.py).

Also runnable directly:

    python -m taps_ray.training.commands features --config configs/cpu.yaml [--mixture math]
    python -m taps_ray.training.commands train --config configs/cpu.yaml --kind hass --mixture math
    python -m taps_ray.training.commands agreement --config configs/cpu.yaml   # every trained head, cached
    python -m taps_ray.training.commands report --config configs/cpu.yaml      # writes <reports_dir>/heads.md
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from taps_ray.config import StudyConfig, load_config
from taps_ray.models.target import Target, load_target
from taps_ray.report.heads import build_heads_report, rerender_heads_md
from taps_ray.training.agreement import measure_agreement
from taps_ray.training.features import extract_features
from taps_ray.training.trainer import configure_threads, train_head

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


def cmd_agreement(cfg: StudyConfig) -> dict[str, dict[str, float | None]]:
    """Measure (or reuse) the held-out agreement of every trained head, for the heads report to read."""
    configure_threads()
    measured = measure_agreement(cfg)
    for label, accuracy in measured.items():
        print(f"{label}: " + ", ".join(f"{d} {acc:.3f}" for d, acc in accuracy.items()))
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taps_ray.training.commands", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("features", "train", "agreement", "report"):
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
    elif args.command == "agreement":
        cmd_agreement(cfg)
    elif args.render_only:
        rerender_heads_md(args.output or cfg.reports_dir)
    else:
        build_heads_report(cfg, output=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
