#!/usr/bin/env python
"""The Ray job driver of the whole study: `taps sweep` with the same flags, runnable without installing the package.

    python jobs/sweep.py --config configs/cpu.yaml [--quick] [--stages data,features,train,eval,report]
    ray job submit --working-dir . -- python jobs/sweep.py --config configs/paper.yaml

Without an address (none in the config, no RAY_ADDRESS) it starts a local Ray on 127.0.0.1; with
`ray.address: auto` or under `ray job submit` it joins the running cluster.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo (or the job's working dir) first

from taps_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
