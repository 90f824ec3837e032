#!/usr/bin/env python
"""What one target verification costs by tree size on each target forward, in the same run. Not a test.

    python benchmarks/speed/forward_width.py --config configs/speed.yaml --dtypes float32 bfloat16 \\
        --out reports/forward_width.md

Tree size is the lever of every speculative method: a tree of k nodes pays when its accepted tokens outweigh what
its forward costs over a one-token forward. Three forwards verify the same trees against the same context, on
the same weights:
* `old`: transformers' model over its `DynamicCache` (what `TargetBatch` ran before the fast forward: the cache
  concatenates itself every forward; cropped back after each verification);
* `hf`: transformers' model over the batch's preallocated `KVCache` (`target.forward: hf`);
* `fast`: taps' own Llama forward over the same cache (`target.forward: fast`, the default).
`old` and `hf` run on a second copy of the model whose weights keep transformers' layout (the fast forward's are
laid out for the CPU's kernels, models/cpu_linear.py). Each includes the LM head over every node. The target
prefills one prompt, then each (forward, size, shape) is verified with the cache cropped back after each forward,
all interleaved and repeated; the median of each is reported. Chains of one token are plain decoding; the `tree` rows are binary trees on the 4-D mask path.
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
from transformers import DynamicCache  # noqa: E402

from taps_ray.config import load_config  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.drafting.tree import DraftTree, build_tree  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.models.fast_llama import FastLlama  # noqa: E402
from taps_ray.models.hf_forward import HFForward  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402

FORWARDS = ("old", "hf", "fast")


def shapes(size: int) -> dict[str, DraftTree]:
    """A chain and a binary tree of `size` nodes (root included), token ids arbitrary: only the cost is read."""
    tokens = torch.full((size,), 5)
    binary = [-1] + [(node - 1) // 2 for node in range(1, size)]
    return {"chain": build_tree(tokens, torch.arange(-1, size - 1)), "tree": build_tree(tokens, torch.tensor(binary))}


def trees_of(sizes: list[int]) -> dict[tuple[int, str], DraftTree]:
    """The chain and binary tree of each size, keyed (size, shape); one node is a chain only."""
    return {(size, kind): tree for size in sizes for kind, tree in shapes(size).items() if size > 1 or kind == "chain"}


def interleaved_medians(verifiers: dict[str, Callable[[DraftTree], None]], trees: dict[tuple[int, str], DraftTree],
                        repetitions: int) -> dict[tuple[str, int, str], float]:
    """Median ms of each (verifier, size, shape), every verifier timed on every tree in turn, `repetitions` rounds
    after one warm-up round: interleaving spreads a shared machine's load over all of them alike."""
    seconds: dict[tuple[str, int, str], list[float]] = {(name, *key): [] for name in verifiers for key in trees}
    for repetition in range(repetitions + 1):
        for key, tree in trees.items():
            for name, verify in verifiers.items():
                start = time.perf_counter()
                verify(tree)
                elapsed = time.perf_counter() - start
                if repetition:
                    seconds[(name, *key)].append(elapsed)
    return {key: 1000 * statistics.median(values) for key, values in seconds.items()}


def old_verifier(model: torch.nn.Module, prompt: list[int]) -> Callable[[DraftTree], None]:
    """transformers' model over a `DynamicCache` holding the prompt: verify a tree as the batch did, crop back."""
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.model(input_ids=ids, cache=cache, use_cache=True)
    past = len(prompt)

    @torch.no_grad()
    def verify(tree: DraftTree) -> None:
        n = tree.size
        positions = (past + tree.depth)[None]
        if tree.is_chain:  # the model's own causal mask, as the batch's causal path
            mask = None
        else:
            mask = torch.ones(1, 1, n, past + n, dtype=torch.bool)
            mask[0, 0, :, past:] = tree.mask
        out = model.model(input_ids=tree.tokens[None], attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=True)
        model.lm_head(out.last_hidden_state)
        cache.crop(-n)  # drop the tree: the cache holds the prompt again

    return verify


def batch_verifier(model: torch.nn.Module, prompt: list[int], forward: FastLlama | HFForward, rows: int = 1
                   ) -> Callable[[DraftTree], None]:
    """Verify a tree in each of `rows` sequences holding the prompt, as one step, then keep nothing."""
    batch = TargetBatch(model, forward=forward)
    batch.start([prompt] * rows, SamplingParams(), list(range(rows)))

    def verify(tree: DraftTree) -> None:
        batch.forward_trees([tree] * rows)
        batch.commit([[]] * rows)  # keep nothing: the cache is back to the prompt

    return verify


def measure(config: str, dtype: str, sizes: list[int], context: int, repetitions: int) -> list[str]:
    cfg = load_config(config)
    target = load_target(cfg.target.model_copy(update={"forward": "fast"}), dtype=dtype)
    model = target.model
    fast = model.taps_target_forward
    assert isinstance(fast, FastLlama), "the benchmark needs a target the fast forward covers"
    # transformers' forwards run on a second copy whose weights keep transformers' layout: the fast forward's
    # HF modules view its CPU-laid-out weights, which would speed them up too (models/cpu_linear.py)
    plain = load_target(cfg.target.model_copy(update={"forward": "hf"}), dtype=dtype).model
    prompt = torch.randint(100, 10_000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    verifiers = {
        "old": old_verifier(plain, prompt),
        "hf": batch_verifier(plain, prompt, HFForward(plain)),
        "fast": batch_verifier(model, prompt, fast),
    }
    trees = trees_of(sizes)
    median = interleaved_medians(verifiers, trees, repetitions)
    lines = [
        f"## {target.dtype}",
        "",
        "| nodes | shape | old ms | hf ms | fast ms | old / fast | hf / fast | fast / fast one token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    one = median[("fast", 1, "chain")]
    for (size, kind) in trees:
        old, hf, new = (median[(name, size, kind)] for name in FORWARDS)
        lines.append(f"| {size} | {kind} | {old:.1f} | {hf:.1f} | {new:.1f} | {old / new:.2f}x | {hf / new:.2f}x "
                     f"| {new / one:.2f} |")
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/speed.yaml")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 60])
    parser.add_argument("--context", type=int, default=160, help="prompt tokens already in the cache")
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()

    sections = [line for dtype in args.dtypes
                for line in measure(args.config, dtype, args.sizes, args.context, args.repetitions)]
    lines = [
        "# Target forward by tree size: taps' fast forward against transformers'",
        "",
        f"Regenerate: `python benchmarks/speed/forward_width.py --config {args.config} --dtypes {' '.join(args.dtypes)}"
        f" --out reports/forward_width.md`. {cpu_line()}; torch threads {torch.get_num_threads()}, torch "
        f"{torch.__version__}. Context {args.context} tokens, median of "
        f"{args.repetitions} interleaved verifications per forward and size, LM head included. `old`: transformers' "
        "model over its DynamicCache (the batch before this forward); `hf`: transformers' model over the batch's "
        "preallocated KVCache (`target.forward: hf`); `fast`: taps' own Llama forward over it (`target.forward: "
        "fast`, the default). `chain`: a chain (one node is plain decoding); `tree`: a binary tree (4-D mask). "
        "Ratios > 1 mean the fast forward is faster. Timings on a shared machine: read the ratios, which come "
        "from interleaved runs, rather than the absolute times.",
        "",
        *sections,
    ]
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
