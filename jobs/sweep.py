#!/usr/bin/env python
"""Driver of the whole study: parse arguments, join or start Ray, run the sweep (taps_ray.cluster.sweep).

    python jobs/sweep.py --config configs/cpu.yaml [--quick] [--stages data,features,train,eval,report]
    ray job submit --working-dir . -- python jobs/sweep.py --config configs/paper.yaml

Without an address (none in the config, no RAY_ADDRESS) it starts a local Ray on 127.0.0.1; with
`ray.address: auto` or under `ray job submit` it joins the running cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (or the job's working dir) first

from taps_ray.cluster.runtime import start_ray  # noqa: E402
from taps_ray.cluster.sweep import add_arguments, config_from_args, run_sweep  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    start_ray(cfg.ray, args.address)
    command = " ".join(["python jobs/sweep.py", *(argv if argv is not None else sys.argv[1:])])
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    results = run_sweep(cfg, quick=args.quick, stages=stages, command=command)
    failed = [*results["stages"].get("train", {}).get("failed", []), *results["stages"].get("eval", {}).get("failed", [])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
