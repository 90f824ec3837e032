#!/usr/bin/env python
"""Cost of a T = 0 evaluation cell, live vs replayed (spec/replay.py), in the same run. Not a test.

    python benchmarks/speed/replay_cost.py --config configs/speed.yaml --questions 4 --out reports/replay.md
    python benchmarks/speed/replay_cost.py --config configs/speed.yaml --questions 4 --dtype float32 --out reports/replay_fp32.md

Each proposer's T = 0 cell runs live (`eval.replay: false`: the target verifies every step, the heads draft every
step) and replayed (the target greedy-decodes the questions once, in one batch; each head drafts its trees at
every root position of those traces in batched forwards, decoding/replay_draft.py; the proposer replays against
the record). The greedy decodes of the questions are timed apart (a cold replay minus a warm one) and shared
over the cells that replay them: these proposers' cells, and the replayed cells of that benchmark in the
config's study. Both runs must give the same question records; the script counts the turns where they differ
(near-ties; in bf16 also the live loop's own drift from the greedy record, see the report's note).

Heads: the trained heads of the config's work dir when they exist, random heads otherwise (they accept almost
nothing, so live cells take one step per token, as plain decoding does; trained heads make live cells cheaper).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from taps_ray.config import StudyConfig, load_config  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402

COMPARED = ["question_id", "turn", "tokens", "steps", "committed"]


def _heads(cfg: StudyConfig, kind: str, target) -> tuple[dict, str]:
    from taps_ray.drafting.setup import load_heads
    from taps_ray.models.draft_head import new_head

    try:
        return load_heads(cfg, kind, target.dtype), f"trained `{kind}` heads from `{cfg.work_dir}`"
    except FileNotFoundError:
        heads = {m: new_head(target.model.config, seed=i).to(target.dtype) for i, m in enumerate(cfg.train.mixtures)}
        return heads, f"random `{kind}` heads (no trained heads in `{cfg.work_dir}`)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--benchmark", default="gsm8k")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--proposers", nargs="+", default=["math", "chat", "averaged", "confidence-routed", "merged"])
    parser.add_argument("--kind", default="eagle2")
    parser.add_argument("--dtype", default=None, help="evaluate in this dtype (default: the config's eval dtype)")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()

    import pandas as pd

    from taps_ray.eval.cell import Cell
    from taps_ray.eval.commands import plan_cells
    from taps_ray.eval.runner import TraceCache, is_replayed, run_cell
    from taps_ray.fsio import report_lines
    from taps_ray.models.target import load_target

    cfg = load_config(args.config)
    evaluation = cfg.eval.model_copy(update={
        "benchmarks": {args.benchmark: args.questions}, "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype or cfg.eval.dtype,
    })
    live_cfg = cfg.model_copy(update={"eval": evaluation.model_copy(update={"replay": False})})
    replay_cfg = cfg.model_copy(update={"eval": evaluation.model_copy(update={"replay": True})})
    target = load_target(cfg.target, dtype=evaluation.dtype)
    heads, heads_note = _heads(cfg, args.kind, target)

    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    cache, rows, differ, turns = TraceCache(), [], 0, 0
    t0 = time.perf_counter()
    run_cell(replay_cfg, Cell(args.kind, args.proposers[0], args.benchmark, 0.0), target, heads, traces=cache)
    cold_s = time.perf_counter() - t0  # the greedy decodes of the questions + one replay
    for name in args.proposers:
        cell = Cell(args.kind, name, args.benchmark, 0.0)
        t0 = time.perf_counter()
        live = pd.DataFrame(run_cell(live_cfg, cell, target, heads)[1])
        t1 = time.perf_counter()
        replayed = pd.DataFrame(run_cell(replay_cfg, cell, target, heads, traces=cache)[1])
        t2 = time.perf_counter()
        same = (live[COMPARED].to_dict("records"), replayed[COMPARED].to_dict("records"))
        differ += sum(a != b for a, b in zip(*same))
        turns += len(live)
        tau = (live["new_tokens"].sum() / live["steps"].sum())
        rows.append((name, t1 - t0, t2 - t1, tau))
    live_s = sum(r[1] for r in rows) / len(rows)
    replay_s = sum(r[2] for r in rows) / len(rows)
    trace_s = max(cold_s - rows[0][2], 0.0)
    sharing = sum(is_replayed(cfg, c) and c.benchmark == args.benchmark for c in plan_cells(cfg))
    command = "python benchmarks/speed/replay_cost.py " + shlex.join(sys.argv[1:])
    lines = [
        "# Replay vs live evaluation of T = 0 cells",
        f"Generated by `{command}`; {target.name} in {str(target.dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} torch threads, {args.questions} {args.benchmark} questions, "
        f"max_new_tokens {args.max_new_tokens}, tree {cfg.tree.total_token}/{cfg.tree.depth}/{cfg.tree.top_k}, "
        f"{heads_note}; 1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
        f"{cpu_line()}.",
        "",
        "| proposer | τ | live s | replayed s |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {tau:.2f} | {a:.1f} | {b:.1f} |" for n, a, b, tau in rows),
        "",
        f"Per cell: live {live_s:.1f} s, replayed {replay_s:.1f} s, plus the questions' greedy decodes "
        f"({trace_s:.1f} s, once per benchmark). Shared by these {len(rows)} cells: "
        f"**{live_s / (replay_s + trace_s / len(rows)):.1f}× cheaper per cell**; shared by the {sharing} replayed "
        f"{args.benchmark} cells of `{cfg.name}`: **{live_s / (replay_s + trace_s / max(sharing, 1)):.1f}×**. "
        f"Question records (tokens, steps, committed) that differ between the two: {differ} of {turns}.",
        "",
        "A replayed cell pays no verification and no per-step draft pass: each head drafts its trees at every root "
        "position of the traces in a few batched forwards, and the questions' greedy decodes (one batch) are shared "
        "by every replayed cell of the benchmark. "
        + ("In bf16 a k-token tree forward and a one-token forward round differently, so the live loop itself drifts "
           "from the target's greedy continuation at near-ties while replay follows the greedy record; records that "
           "differ here are that drift. In fp32 replay equals the live loop up to rare near-ties "
           "(`tests/test_replay.py` counts them)." if target.dtype != torch.float32 else
           "In fp32 a record that differs is a floating-point near-tie (a batched and a per-step forward round "
           "differently in the last bits)."),
    ]
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
