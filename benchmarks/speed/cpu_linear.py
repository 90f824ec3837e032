#!/usr/bin/env python
"""Matmul kernels at decoding sizes on this CPU: `F.linear` over the weight as transformers stores it against
the layouts `models/cpu_linear.py` picks, for SmolLM2-135M's projection shapes. Not a test.

    python benchmarks/speed/cpu_linear.py --out reports/cpu_linear.md

Rows: 1 (plain decoding), 4-64 (tree verification), 256 (prefill); fp32 at one row also times the layout
`FP32_ONE_ROW_PACKED` does not pick (oneDNN's packed weight or the plain [in, out] one). Each candidate is timed
in rounds that alternate with the others (median of the rounds), so a shared machine slows them alike; outputs
are compared with `F.linear`'s (max abs difference: the kernels sum in other orders).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.cpu_linear import FP32_ONE_ROW_PACKED, Projection  # noqa: E402

ONE_ROW = {True: "through oneDNN's weight packed for 32 rows",
           False: "over an [in, out] layout for a widening projection, transformers' for a narrowing one"}
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def interleaved(candidates: dict[str, Callable[[], torch.Tensor]], rounds: int, calls: int) -> dict[str, float]:
    """Median microseconds per call of each candidate, timed in alternating rounds."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for run in candidates.values():
        run()
    for _ in range(rounds):
        for name, run in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lines = ["# Matmul kernels at decoding sizes", "",
             f"`python benchmarks/speed/cpu_linear.py{' --out ' + args.out if args.out else ''}`. {cpu_line()}; "
             f"torch {torch.__version__}, {args.threads} threads. `F.linear`: the weight as transformers stores it "
             "([out, in]); `taps`: `models.cpu_linear.Projection` (fp32: one row "
             f"{ONE_ROW[FP32_ONE_ROW_PACKED]} on this CPU, several rows through oneDNN's reordered weight; bf16: "
             "oneDNN's at every size); `other one-row layout`: fp32 one row "
             f"{ONE_ROW[not FP32_ONE_ROW_PACKED]}. Median µs per call of alternating rounds; `diff`: max abs "
             "difference from `F.linear`'s output.", "",
             "| dtype | rows | projection [out×in] | F.linear µs | taps µs | speedup | other one-row layout µs "
             "| diff |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    with torch.no_grad():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for rows in args.rows:
                for name, (out_features, in_features) in SHAPES.items():
                    linear = nn.Linear(in_features, out_features, bias=False).to(dtype).requires_grad_(False)
                    weight = linear.weight.detach().clone()
                    projection = Projection.fused([linear])
                    x = torch.randn(rows, in_features, dtype=dtype)
                    work = rows * out_features * in_features
                    candidates = {"linear": lambda: F.linear(x, weight), "taps": lambda: projection(x)}
                    if dtype == torch.float32 and rows == 1:
                        other = Projection([weight], pack_one_row=not FP32_ONE_ROW_PACKED)
                        candidates["other"] = lambda: other(x)
                    timed = interleaved(candidates, rounds=max(5, min(30, int(3e9 / work))),
                                        calls=max(1, min(20, int(3e8 / work))))
                    diff = (projection(x).float() - F.linear(x, weight).float()).abs().max().item()
                    other_us = f"{timed['other']:.0f}" if "other" in timed else "-"
                    lines.append(f"| {dtype_name} | {rows} | {name} [{out_features}×{in_features}] | "
                                 f"{timed['linear']:.0f} | {timed['taps']:.0f} | {timed['linear'] / timed['taps']:.2f}x | "
                                 f"{other_us} | {diff:.1e} |")
                    print(lines[-1], flush=True)
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
