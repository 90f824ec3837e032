#!/usr/bin/env python
"""Draft milliseconds per step, this tree's drafting vs a baseline commit's, in the same run. Not a test.

    python benchmarks/speed/draft_profile.py --config configs/speed.yaml --baseline bf5d537 --out reports/draft_profile.md

The target greedy-decodes a few GSM8K and MT-Bench prompts once with the first head and the draft inputs of every
step (committed features and tokens) are recorded. Each proposer then replays that sequence of draft calls
through the baseline's `draft_eagle2` (its `drafting/eagle2.py`, `drafting/tree.py` before the split, or
`engine/tree.py` before the layout, and
`models/draft_head.py`, read from git, heads rebuilt from the same weights, drafted one after the other; a router
or merger then combines the trees with this tree's `combine`) and through this tree's proposer, interleaved and repeated with the order alternating, so both
sides see the same machine load. Trees are compared node for node: tokens, parents, confidence and entropy bit for
bit, and tokens and parents alone (the same tree with floats that differ in the last bits: another kernel's
rounding, which depends on the CPU family).
"""

from __future__ import annotations

import argparse
import inspect
import os
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from taps_ray.config import load_config  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402

FIELDS = ("tokens", "parents", "confidence", "entropy")


def _git_module(rev: str, path: str, name: str, replaces: dict[str, types.ModuleType]) -> types.ModuleType:
    """`path` at `rev` as module `name`, its imports of the modules in `replaces` bound to the given ones."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(name)
    saved = {key: sys.modules.get(key) for key in replaces}
    sys.modules.update(replaces)
    sys.modules[name] = module
    try:
        exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    finally:
        for key, value in saved.items():
            sys.modules[key] = value
    return module


def baseline(rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The baseline's draft head and tree modules."""
    head = _git_module(rev, "taps_ray/models/draft_head.py", "baseline_draft_head", {})
    # drafting/tree.py: a baseline from before EAGLE-2 left the tree module; engine/tree.py: before drafting/
    paths = ("taps_ray/drafting/eagle2.py", "taps_ray/drafting/tree.py", "taps_ray/engine/tree.py")
    tree_path = next(path for path in paths
                     if subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT,
                                   stderr=subprocess.DEVNULL).returncode == 0)
    tree = _git_module(rev, tree_path, "baseline_tree", {"taps_ray.models.draft_head": head})
    return head, tree


def baseline_drafter(head_mod, tree_mod, heads: list, context, tree_cfg):
    """The baseline's drafting of `heads` (one tree per head, drafted one after the other)."""
    rebuilt = []
    for head in heads:
        old = head_mod.DraftHead(head_mod.DraftHeadConfig.model_validate(head.config.model_dump()))
        old.load_trainable(head.trainable_state())
        param = next(head.parameters())
        rebuilt.append(old.to(device=param.device, dtype=param.dtype).eval())
    ctx = tree_mod.DraftContext(context.embed, context.lm_head, context.vocab)
    # since the one drafting entry: draft_eagle2(head, ctx, caches, features, next_tokens, tree) over sequences;
    # before it: one sequence's tree from int settings
    batched = "caches" in inspect.signature(tree_mod.draft_eagle2).parameters
    settings = tree_cfg.model_copy(update={"min_confidence": 0.0})  # the baseline drafts every level

    def one(h, s, features, next_tokens):
        if batched:
            ((tree,),), (cache,) = tree_mod.draft_eagle2(h, ctx, [s], [features], [next_tokens], settings)
            return tree, cache
        return tree_mod.draft_eagle2(h, ctx, s, features, next_tokens, tree_cfg.total_token, tree_cfg.depth,
                                     tree_cfg.top_k)

    def draft(states, features, next_tokens):
        out = [one(h, s, features, next_tokens) for h, s in zip(rebuilt, states)]
        return [t for t, _ in out], [s for _, s in out]

    return draft, lambda: [tree_mod.HeadCache() for _ in rebuilt]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/speed.yaml")
    parser.add_argument("--baseline", required=True, help="git revision whose drafting is the reference")
    parser.add_argument("--per-benchmark", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repetitions", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the config's)")
    parser.add_argument("--proposers", nargs="+", default=["math", "chat", "confidence-routed"])
    parser.add_argument("--compile", action="store_true",
                        help="this tree's heads draft through torch.compile(head.step, dynamic=True); compiling "
                        "happens in the warm-up (with --baseline HEAD: compiled vs eager drafting of one tree)")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()

    from taps_ray.bench.run import BenchOptions, GREEDY, bench_prompts
    from taps_ray.decoding.generate import run_loop
    from taps_ray.decoding.target_batch import TargetBatch
    from taps_ray.drafting.combine import RouterState
    from taps_ray.drafting.proposers import Recording
    from taps_ray.drafting.setup import load_proposers
    from taps_ray.fsio import report_lines
    from taps_ray.models.target import load_target

    torch.manual_seed(0)
    cfg = load_config(args.config)
    target = load_target(cfg.target, dtype=args.dtype)
    prompts = bench_prompts(cfg, target, BenchOptions(benchmarks=["gsm8k", "mt_bench"], per_benchmark=args.per_benchmark))
    proposers = load_proposers(cfg, args.proposers, target=target, kind="eagle2")
    first = Recording(proposers[args.proposers[0]])
    recorded = []
    for _, prompt in prompts:
        first.calls = []
        run_loop(TargetBatch(target.model), first, [prompt], GREEDY, args.max_new_tokens, target.stop_token_ids)
        recorded.append(first.calls)
    steps = sum(len(calls) for calls in recorded)
    head_mod, tree_mod = baseline(args.baseline)

    rows = []
    for name in args.proposers:
        proposer = proposers[name]
        parts = getattr(proposer, "parts", [proposer])
        old_draft, old_init = baseline_drafter(head_mod, tree_mod, [p.head for p in parts], parts[0].context, cfg.tree)
        if args.compile:
            for part in parts:
                part.head.step = torch.compile(part.head.step, dynamic=True)
        seconds = {"baseline": 0.0, "this tree": 0.0}
        same = shaped = total = 0

        combine = getattr(proposer, "combine", None)  # a router's or merger's choice from its parts' trees

        def run_old(calls):
            states, trees = old_init(), []
            for features, tokens, *_ in calls:
                drafted, states = old_draft(states, features, tokens)
                trees.append([combine(drafted, RouterState(parts=()))[0]] if combine else drafted)
            return trees

        def run_new(calls):
            state, trees = proposer.init_state(), []
            for features, tokens, *_ in calls:
                tree, state = proposer.propose(state, features, tokens)
                trees.append(tree)
            return trees

        run_old(recorded[0]), run_new(recorded[0])  # warm-up
        for repetition in range(args.repetitions):
            order = [("baseline", run_old), ("this tree", run_new)][:: 1 if repetition % 2 == 0 else -1]
            for calls in recorded:
                out = {}
                for side, fn in order:
                    start = time.perf_counter()
                    out[side] = fn(calls)
                    seconds[side] += time.perf_counter() - start
                if repetition == 0:
                    for old_trees, new_tree in zip(out["baseline"], out["this tree"]):
                        total += 1
                        same += any(all(torch.equal(getattr(t, f), getattr(new_tree, f)) for f in FIELDS)
                                    for t in old_trees)
                        shaped += any(all(torch.equal(getattr(t, f), getattr(new_tree, f)) for f in FIELDS[:2])
                                      for t in old_trees)
        per_step = {k: 1000 * v / (steps * args.repetitions) for k, v in seconds.items()}
        rows.append((name, per_step["baseline"], per_step["this tree"], per_step["this tree"] / per_step["baseline"],
                     f"{same}/{total}", f"{shaped}/{total}"))

    command = "python benchmarks/speed/draft_profile.py " + shlex.join(sys.argv[1:])
    lines = [
        f"Draft ms per step, {steps} recorded steps x {args.repetitions} repetitions, target dtype "
        f"{target.dtype}, tree {cfg.tree.total_token}/{cfg.tree.depth}/{cfg.tree.top_k}, "
        f"torch threads {torch.get_num_threads()}{', this tree compiled' if args.compile else ''}; {cpu_line()}. "
        f"Regenerate: `{command}`.",
        "",
        "| proposer | baseline ms/step | this tree ms/step | ratio | trees bit-identical to the baseline's | same "
        "tokens and parents |",
        "|---|---|---|---|---|---|",
        *(f"| {n} | {a:.2f} | {b:.2f} | {r:.2f} | {s} | {p} |" for n, a, b, r, s, p in rows),
    ]
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
