#!/usr/bin/env python
"""The fast forward compiled (`target.compile: inductor`) against the same forward eager, in the same run. Not a test.

    nice python benchmarks/speed/compiled_forward.py --configs configs/tiny.yaml configs/speed.yaml \\
        --out reports/compiled_forward.md

Two copies of the target (same weights) verify the same chains and binary trees of 1, 4 and 16 nodes against the
same context, interleaved and repeated, with the cache cropped back after each (benchmarks/speed/forward_width.py's
verifier); the median of each is reported, with the seconds the compiled copy's first verifications took to
compile. The LM head (eager in both) is included. `--dtype`: fp32 (the default, as the equality tests) or bf16.
`--rows`: how many sequences verify a tree each in one step (a Serve replica's batch; compiled, the trees are
packed side by side into one row of the layer graph).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# OpenMP's idle threads wait as a Serve replica's do (serve.replica_omp_wait: default), the forward this compares
# being the replica's: with them sleeping at once, the graph's fewer, larger kernels gained less over eager
os.environ.setdefault("GOMP_SPINCOUNT", "300000")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from forward_width import batch_verifier, interleaved_medians, trees_of  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.machine import cpu_line, omp_wait_line  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402
from taps_ray.models.target_forward import target_forward  # noqa: E402

MODES = ("none", "inductor")


def measure(config: str, sizes: list[int], context: int, repetitions: int, dtype: str, rows: int) -> list[str]:
    cfg = load_config(config)
    verifiers = {}
    prompt = torch.randint(100, 10_000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    trees = trees_of(sizes)
    for mode in MODES:
        target = load_target(cfg.target.model_copy(update={"forward": "fast", "compile": mode}), dtype=dtype)
        forward = target_forward(target.model)
        if forward.compiled != (mode == "inductor"):
            raise SystemExit(f"target.compile {mode} did not build that forward here (see the log line above)")
        verifiers[mode] = batch_verifier(target.model, prompt, forward, rows)
    start = time.perf_counter()
    for tree in trees.values():  # every shape family compiles on its first verification
        verifiers["inductor"](tree)
    compile_s = time.perf_counter() - start
    median = interleaved_medians(verifiers, trees, repetitions)
    lines = [
        f"## {cfg.target.name} ({dtype}), {rows} row(s); the first verification of every tree took {compile_s:.0f} s "
        "(compiling, or loading inductor's on-disk cache of an earlier run)",
        "",
        "| nodes | shape | eager ms | compiled ms | eager / compiled |",
        "|---|---|---|---|---|",
    ]
    for size, kind in trees:
        eager, compiled = median[("none", size, kind)], median[("inductor", size, kind)]
        lines.append(f"| {size} | {kind} | {eager:.2f} | {compiled:.2f} | {eager / compiled:.2f}x |")
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/tiny.yaml", "configs/speed.yaml"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=160, help="prompt tokens already in the cache")
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1],
                        help="sequences verifying a tree each in one step (a batch of trees is packed into one row)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--note", default="", help="a sentence on the machine's load, printed in the report")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()

    sections = [line for config in args.configs for rows in args.rows
                for line in measure(config, args.sizes, args.context, args.repetitions, args.dtype, rows)]
    lines = [
        "# The fast forward compiled (target.compile: inductor) against eager",
        "",
        f"Regenerate: `nice python benchmarks/speed/compiled_forward.py --configs {' '.join(args.configs)} "
        f"--dtype {args.dtype} --rows {' '.join(map(str, args.rows))} "
        f"--out {args.out or 'reports/compiled_forward.md'}`. "
        f"{cpu_line()}; torch threads {torch.get_num_threads()}, {omp_wait_line()}, torch "
        f"{torch.__version__}. Context {args.context} tokens, median of {args.repetitions} interleaved verifications "
        "per forward and tree, LM head included (eager in both). `chain`: a chain (one node is plain decoding); "
        "`tree`: a binary tree. Ratios > 1 mean the compiled forward is faster. Read the ratios, which come from "
        f"interleaved runs, rather than the absolute times. {args.note}",
        "",
        *sections,
    ]
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
