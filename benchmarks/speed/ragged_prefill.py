#!/usr/bin/env python
"""What a prefill of ragged prompts costs three ways, in the same run, as ratios to the unmasked one. Not a test.

    python benchmarks/speed/ragged_prefill.py --out reports/ragged_prefill.md

The target (`--config`'s, fp32) prefills the same right-padded batch of prompts of different lengths:
* `unmasked`: one padded forward, plain causal attention, no mask (a real token sees only real tokens before it,
  so padding changes nothing it computes, and the attention takes the `is_causal` kernels);
* `masked`: one padded forward with the boolean mask (causal and within each prompt's length) the prefill
  passed before, which rules out those kernels and costs a mask per layer;
* `by length`: one unmasked forward per distinct length, no padding computed (`TargetBatch.prefill`).
Each is repeated interleaved; the median of each is reported with its ratio to `unmasked` (above 1: slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from taps_ray.config import load_config  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402
from taps_ray.syncs import to_device  # noqa: E402


def padded_prefill(batch: TargetBatch, prompts: list[list[int]], masked: bool) -> None:
    """One forward over the right-padded prompts, under the boolean [B, 1, W, W] mask the prefill passed before
    (`masked`) or none."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = to_device([p + [0] * (width - len(p)) for p in prompts], batch.device, torch.long)
    columns = torch.arange(width, device=batch.device)
    mask = None
    if masked:
        valid = columns[None, :] < to_device(lengths, batch.device)[:, None]
        mask = (columns[None, :] <= columns[:, None])[None] & valid[:, None, :]
        mask = (mask | torch.eye(width, dtype=torch.bool, device=batch.device)[None])[:, None]
    batch.cache.reset(len(prompts))
    batch._forward(ids, columns.expand(len(prompts), -1), mask)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/speed.yaml")
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 96, 160, 224, 256, 300, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = load_config(args.config)
    target = load_target(config.target.model_copy(update={"device": "cpu", "dtype": "float32"}))
    generator = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=generator).tolist() for n in args.lengths]
    batch = TargetBatch(target.model)
    runs: dict[str, Callable[[], object]] = {"unmasked": lambda: padded_prefill(batch, prompts, masked=False),
                                             "masked": lambda: padded_prefill(batch, prompts, masked=True),
                                             "by length": lambda: batch.prefill(prompts)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    command = "python benchmarks/speed/ragged_prefill.py" + (f" --out {args.out}" if args.out else "")
    lines = ["# Ragged prefill: unmasked, masked, by length", "",
             f"Regenerate with `{command}`. {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} "
             f"threads. Target {config.target.name} in fp32; prompt lengths {args.lengths} (random tokens), "
             f"median of {args.repeats} interleaved runs each (benchmarks/speed/ragged_prefill.py says what each "
             "run does). The ratios are the reading: runs are interleaved, so the load of a shared machine "
             "scales all three alike, not their ms.", "",
             "| prefill | ms | ratio to unmasked |", "|---|---:|---:|"]
    lines += [f"| {name} | {1e3 * m:.0f} | {m / medians['unmasked']:.2f} |" for name, m in medians.items()]
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
