#!/usr/bin/env python
"""A batch's draft call when its sequences hand the head different numbers of positions: this tree against a
baseline commit's drafting, the same inputs, interleaved, in one run. Not a test.

    python benchmarks/speed/catch_up.py --config configs/interop.yaml --baseline a56966c --out reports/catch_up.md

Serve drafts a batch's sequences in one call (`draft_eagle2`), each handing over the positions committed since
its last draft. Those counts differ: 1 to depth+1 on a drafting step, and after the replica's gate paused
drafting (docs/serve.md#the-draft-gate) a sequence's whole backlog, its prompt when it joined during the pause.
Prompts of GSM8K and MT-Bench are decoded once by the served tree with the head, their draft calls recorded;
the first `--rows` that run for `--pause` + 2 steps (a GSM8K prompt, then an MT-Bench one, ...) make three batches:
- `joined`: every sequence's first call (its prompt), as when the whole batch joined during a pause;
- `paused`: half the sequences cached through their first call and handing over their next `--pause` steps, the
  other half joined during the pause (their prompt and those steps);
- `drafting`: every sequence cached through `--pause` steps and handing over its next step's positions.
The trees are compared node for node (tokens and parents) with the baseline's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from draft_profile import _git_module  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402

Pair = tuple[torch.Tensor, torch.Tensor]  # one sequence's features and next tokens


def batches(recorded: list[list[Pair]], pause: int) -> dict[str, tuple[list[Pair | None], list[Pair]]]:
    """Per scenario, (what each sequence's cache holds before, None: nothing; what the timed call hands over)."""
    from taps_ray.drafting.proposer import join_pending

    half = len(recorded) // 2

    def split(cached: list[list[Pair]], handed: list[list[Pair]]) -> tuple[list[Pair | None], list[Pair]]:
        return [join_pending(c) if c else None for c in cached], [join_pending(h) for h in handed]

    return {
        "joined": split([[] for _ in recorded], [calls[:1] for calls in recorded]),
        "paused": split([calls[:1] if s < half else [] for s, calls in enumerate(recorded)],
                        [calls[1:pause + 1] if s < half else calls[:pause + 1] for s, calls in enumerate(recorded)]),
        "drafting": split([calls[:pause + 1] for calls in recorded],
                          [calls[pause + 1:pause + 2] for calls in recorded]),
    }


def timed_draft(module, proposer, before: list[Pair | None], handed: list[Pair], tree) -> tuple[float, list]:
    """Seconds of `module.draft_eagle2` over `handed`, from fresh caches holding `before` (built untimed, by this
    tree's extension), and its trees."""
    from taps_ray.drafting.eagle2 import HeadCache, extend_batch

    caches = [HeadCache() for _ in handed]
    cached = [s for s, pair in enumerate(before) if pair is not None]
    if cached:
        _, fresh, _ = extend_batch(proposer.head, proposer.context, [HeadCache() for _ in cached],
                                   [before[s][0] for s in cached], [before[s][1] for s in cached])
        for s, cache in zip(cached, fresh):
            caches[s] = cache
    start = time.perf_counter()
    trees, _ = module.draft_eagle2(proposer.head, proposer.context, caches, [f for f, _ in handed],
                                   [t for _, t in handed], tree)
    return time.perf_counter() - start, trees


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/interop.yaml")
    parser.add_argument("--baseline", required=True, help="git revision whose drafting is the reference")
    parser.add_argument("--heads", nargs="+", default=["eagle2", "eagle3"], help="head kinds of the math mixture")
    parser.add_argument("--rows", type=int, default=16, help="sequences drafted together")
    parser.add_argument("--pause", type=int, default=32, help="steps a paused sequence hands over at once")
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the config's)")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()

    from taps_ray.bench.run import GREEDY, BenchOptions, bench_prompts
    from taps_ray.decoding.generate import run_loop
    from taps_ray.decoding.target_batch import TargetBatch
    from taps_ray.drafting import eagle2
    from taps_ray.drafting.proposers import Recording
    from taps_ray.drafting.setup import load_proposers
    from taps_ray.fsio import report_lines
    from taps_ray.models.target import load_target

    torch.manual_seed(0)
    cfg = load_config(args.config).served()
    target = load_target(cfg.target, dtype=args.dtype)
    per_benchmark = args.rows  # twice the rows: a prompt whose answer ends before `--pause` + 2 steps is left out
    prompts = bench_prompts(cfg, target, BenchOptions(benchmarks=["gsm8k", "mt_bench"], per_benchmark=per_benchmark))
    alternated = [prompts[i] for pair in zip(range(per_benchmark), range(per_benchmark, 2 * per_benchmark))
                  for i in pair]  # GSM8K's first, MT-Bench's first, GSM8K's second, ...
    old = _git_module(args.baseline, "taps_ray/drafting/eagle2.py", "baseline_eagle2", {})
    header = ("| head | batch | positions handed over (min / max / sum) | padded | baseline ms | this tree ms | "
              "ratio | same trees |")
    lines = [header, "|---|---|---|---|---:|---:|---:|---|"]
    for kind in args.heads:
        head_name = cfg.train.mixtures[0]
        proposer = load_proposers(cfg, [head_name], target=target, kind=kind)[head_name]
        recorder = Recording(proposer)
        recorded = []
        for _, prompt in alternated:
            recorder.calls = []
            run_loop(TargetBatch(target.model), recorder, [prompt], GREEDY, (cfg.tree.depth + 1) * (args.pause + 2),
                     target.stop_token_ids)
            if len(recorder.calls) >= args.pause + 2:
                recorded.append([(f, t) for f, t, *_ in recorder.calls])
            if len(recorded) == args.rows:
                break
        else:
            raise SystemExit(f"only {len(recorded)} prompts decode for {args.pause + 2} steps; lower --pause or --rows")
        for scenario, (before, handed) in batches(recorded, args.pause).items():
            timed: dict[str, list[float]] = {"baseline": [], "this tree": []}
            outputs = {}
            for repetition in range(args.repetitions + 1):  # the first is a warm-up
                order = [("baseline", old), ("this tree", eagle2)][:: 1 if repetition % 2 == 0 else -1]
                for side, module in order:
                    seconds, outputs[side] = timed_draft(module, proposer, before, handed, cfg.tree)
                    if repetition:
                        timed[side].append(seconds)
            same = sum(all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) for a, b in zip(x, y))
                       for x, y in zip(outputs["baseline"], outputs["this tree"]))
            counts = [int(t.numel()) for _, t in handed]
            base, new = (1000 * statistics.median(timed[k]) for k in ("baseline", "this tree"))
            lines.append(f"| {kind}-{head_name} | {scenario} | {min(counts)} / {max(counts)} / {sum(counts)} | "
                         f"{max(counts) * len(counts)} | {base:.1f} | {new:.1f} | {new / base:.2f} | "
                         f"{same}/{len(counts)} |")
            print(lines[-1], flush=True)
    tree = cfg.tree
    command = "python benchmarks/speed/catch_up.py " + shlex.join(sys.argv[1:])
    report_lines([
        "# A batch's draft call over context updates of different lengths",
        "",
        f"Median ms of one batched draft call (`draft_eagle2`: the head's extension over the handed-over positions, "
        f"then the tree), {args.repetitions} repetitions interleaved with the baseline ({args.baseline}); "
        f"{args.rows} sequences, target dtype {target.dtype}, served tree {tree.total_token}/{tree.depth}/"
        f"{tree.top_k}, torch threads {torch.get_num_threads()}; {cpu_line()}. `padded`: the positions a padded "
        f"extension runs (rows x the longest). Regenerate: `{command}`.",
        "",
        *lines,
    ], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
