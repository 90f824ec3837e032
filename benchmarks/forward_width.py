#!/usr/bin/env python
"""What one target verification costs by tree size, chains and branching trees, in the same run. Not a test.

    python benchmarks/forward_width.py --config configs/speed.yaml --dtype float32 --out reports/forward_width.md

Tree size is the lever of every speculative method: a tree of k nodes pays when its accepted tokens outweigh what
its forward costs over a one-token forward. The target prefills one prompt, then each tree is verified against
that same context (the cache cropped back after each forward), sizes interleaved and repeated; the median of
each is reported with its ratio to a single token. Branching trees take the 4-D mask path, chains the model's own
causal path, so the two columns also show what the mask costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from taps_ray.config import load_config  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.drafting.tree import DraftTree, build_tree  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402


def shapes(size: int) -> dict[str, DraftTree]:
    """A chain and a binary tree of `size` nodes (root included), token ids arbitrary: only the cost is read."""
    tokens = torch.full((size,), 5)
    binary = [-1] + [(node - 1) // 2 for node in range(1, size)]
    return {"chain": build_tree(tokens, torch.arange(-1, size - 1)), "tree": build_tree(tokens, torch.tensor(binary))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/speed.yaml")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the config's)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 11, 12, 16, 24, 32])
    parser.add_argument("--context", type=int, default=160, help="prompt tokens already in the cache")
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = load_config(args.config)
    target = load_target(cfg.target, dtype=args.dtype)
    batch = TargetBatch(target.model)
    prompt = torch.randint(100, 10_000, (args.context,)).tolist()
    batch.start([prompt], SamplingParams(), [0])
    trees = {(size, kind): tree for size in args.sizes for kind, tree in shapes(size).items() if size > 1 or kind == "chain"}
    seconds: dict[tuple[int, str], list[float]] = {key: [] for key in trees}
    for repetition in range(args.repetitions + 1):  # the first round warms up
        for key, tree in trees.items():
            start = time.perf_counter()
            batch.verify([tree])
            elapsed = time.perf_counter() - start
            batch.commit([[]])  # keep nothing: the cache is back to the prompt
            if repetition:
                seconds[key].append(elapsed)
    median = {key: 1000 * statistics.median(values) for key, values in seconds.items()}
    one = median[(1, "chain")]
    lines = [
        "# Target forward by tree size",
        "",
        f"Regenerate: `python benchmarks/forward_width.py --config {args.config}"
        f"{' --dtype ' + args.dtype if args.dtype else ''}`. {target.dtype}, context {args.context} tokens, median "
        f"of {args.repetitions} interleaved verifications per size, torch threads {torch.get_num_threads()}; "
        f"{cpu_line()}. `chain`: the model's causal path; `tree`: a binary tree on the 4-D mask path.",
        "",
        "| nodes | chain ms | tree ms | chain / one token | tree / one token |",
        "|---|---|---|---|---|",
    ]
    for size in args.sizes:
        chain, tree = median[(size, "chain")], median.get((size, "tree"))
        tree_ms, tree_ratio = (f"{tree:.1f}", f"{tree / one:.2f}") if tree is not None else ("–", "–")
        lines.append(f"| {size} | {chain:.1f} | {tree_ms} | {chain / one:.2f} | {tree_ratio} |")
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
