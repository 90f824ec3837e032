#!/usr/bin/env python
"""Does speculation ever lose in Serve? Drafting models with and without the measured drafting gate, against plain
decoding, at several concurrencies. Not a test.

    python benchmarks/serving/draft_gate.py --config configs/data_size.yaml --models math,confidence-routed \
        --concurrency 1,4,16 --out reports/draft_gate.md
    python benchmarks/serving/draft_gate.py --config configs/interop.yaml --dtype float32 --models math \
        --trees 16/4/4,4/3/1 --concurrency 1,4 --repetitions 2 --out reports/served_tree.md
    python benchmarks/serving/draft_gate.py --config configs/interop.yaml --dtype float32 --models math \
        --draft-dtypes float32,bfloat16 --concurrency 1,4 --repetitions 2 --out reports/draft_dtype.md

Serve's engine without HTTP (`ContinuousBatcher`, as a replica builds it: the replica's target forward, on a
CPU under `target.compile: auto` the layer graph, warmed up as the replica warms it; its prefill budget and its
OpenMP spin; every drafting model under the per-sequence cost model), a closed loop of `--concurrency` requests
in flight over `--prompts` prompts (half GSM8K, half MT-Bench first turns), `--max-tokens` tokens each, greedy;
the heads draft the config's served tree (serve.tree) or each of `--trees`, in the config's serve.draft_dtype or
each of `--draft-dtypes`. Each drafting model, tree and draft dtype runs twice: with the drafting gate off
(`serve.measure_drafting: false`, no `draft_below`: every batch drafts) and on (the default: a batch drafts only
where drafted steps measured faster at its size). Per concurrency the runs are interleaved (plain, then each model
and gate) `--repetitions` times in one process, after an unmeasured wave at that load: read the ratios to plain,
not absolute speeds.
Every output is checked against plain decoding's (fp32: token for token). `drafted` is the share of the steps
the gate timed (no request joining) that drafted: how often the gate let the batch draft.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# OpenMP's idle threads wait as a Serve replica's do (serve.replica_omp_wait: default; libgomp reads it at load)
os.environ.setdefault("GOMP_SPINCOUNT", "300000")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from taps_ray.bench.closed_loop import LoopTimes, closed_loop, mixed_prompts, percentile  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.decoding.continuous import ContinuousBatcher  # noqa: E402
from taps_ray.decoding.draft_gate import DraftGate  # noqa: E402
from taps_ray.drafting.cost import CostAware  # noqa: E402
from taps_ray.drafting.proposers import PlainDecoding  # noqa: E402
from taps_ray.drafting.setup import draft_dtype, heads_needed, load_heads, load_proposers  # noqa: E402
from taps_ray.fsio import atomic_write_text  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.markdown import md_table  # noqa: E402
from taps_ray.models.target import dtype_name, load_target  # noqa: E402
from taps_ray.serve.warm_up import warm_up  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/data_size.yaml")
    parser.add_argument("--kind", default="eagle2", help="the trained heads' kind")
    parser.add_argument("--models", default="math,confidence-routed")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trees", default="", help="tree shapes the drafting models draft, T/D/K (total_token/depth/"
                        "top_k), comma-separated; default: the config's served tree (serve.tree over its tree)")
    parser.add_argument("--dtype", default="", help="the target's dtype (default: the config's)")
    parser.add_argument("--draft-dtypes", default="", help="dtypes the heads draft in (or auto), comma-separated; "
                        "default: the config's serve.draft_dtype (unset: the target's)")
    parser.add_argument("--out", default="reports/draft_gate.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_config(args.config).served()
    if args.dtype:
        config = config.model_copy(update={"target": config.target.model_copy(update={"dtype": args.dtype})})
    target = load_target(config.target, serving=True)  # the replica's forward, compiled or not
    names = args.models.split(",")
    served = config.tree
    trees = ({shape: served.with_shape(shape) for shape in args.trees.split(",")} if args.trees else
             {f"{served.total_token}/{served.depth}/{served.top_k}": served})
    draft_dtypes = {dtype_name(dtype): dtype for dtype in (
        draft_dtype(choice, target) for choice in (args.draft_dtypes.split(",") if args.draft_dtypes else
                                                   [config.serve.draft_dtype]))}
    drafts = [(shape, dtype) for shape in trees for dtype in draft_dtypes]
    heads = {name: load_heads(config, args.kind, dtype, heads_needed(config, names), target.device)
             for name, dtype in draft_dtypes.items()}
    proposers = {(name, shape, dtype): proposer for shape, dtype in drafts for name, proposer in load_proposers(
        config.model_copy(update={"tree": trees[shape]}), names, target=target, heads=heads[dtype]).items()}
    prompts = mixed_prompts(config, target.tokenizer, args.prompts)
    layers = {p.feature_layers for p in proposers.values()}.pop()
    runs = [("plain", ("-", "-"), "-", False)] + [(name, draft, gate, gate == "on") for name in names
                                                  for draft in drafts for gate in ("off", "on")]

    def batcher(concurrency: int, gate: DraftGate) -> ContinuousBatcher:
        return ContinuousBatcher(target.model, target.stop_token_ids, concurrency, gate=gate, feature_layers=layers,
                                 prefill_tokens=config.serve.prefill_tokens)

    warm_up(batcher(1, DraftGate()), PlainDecoding(), prompts[0])  # as the replica does before it serves
    rows, results, drafted = [], {}, {}
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        warm = batcher(concurrency, DraftGate())  # an unmeasured wave at this load: its first steps build kernels
        closed_loop(warm, prompts[:concurrency], PlainDecoding(), concurrency, 8)
        for repetition in range(args.repetitions):
            for name, draft, label, measured in runs:
                proposer = PlainDecoding() if name == "plain" else CostAware(proposers[(name, *draft)], name=name)
                gate = DraftGate(config.serve.draft_below if measured else None, measured=measured)
                times = closed_loop(batcher(concurrency, gate), prompts, proposer, concurrency, args.max_tokens)
                results.setdefault((concurrency, name, draft, label), []).append(times)
                drafted.setdefault((concurrency, name, draft, label), []).append(drafted_share(gate))
                print(f"c={concurrency} rep {repetition} {name} tree {draft[0]} draft {draft[1]} gate {label}: "
                      f"{times.tokens_per_s:.1f} tok/s", flush=True)
        plain = results[(concurrency, "plain", ("-", "-"), "-")]
        plain_rate = statistics.mean(t.tokens_per_s for t in plain)
        for name, draft, label, _ in runs:
            timed: list[LoopTimes] = results[(concurrency, name, draft, label)]
            rate = statistics.mean(t.tokens_per_s for t in timed)
            same = sum(a == b for t in timed for a, b in zip(t.outputs, plain[0].outputs))
            shares = [share for share in drafted[(concurrency, name, draft, label)] if share is not None]
            rows.append([str(concurrency), name, *draft, label, f"{rate:.1f}", f"{rate / plain_rate:.2f}x",
                         " / ".join(f"{t.tokens_per_s:.1f}" for t in timed),
                         f"{statistics.mean(shares):.0%}" if shares else "-",
                         f"{statistics.mean(percentile(t.first, 0.5) for t in timed) * 1000:.0f}",
                         f"{same}/{len(prompts) * len(timed)}"])
    command = "python benchmarks/serving/draft_gate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Speculation in Serve, with and without the measured drafting gate", "",
             f"Regenerate: `{command}`. Machine: {cpu_line()}; {args.threads} torch threads; target "
             f"{config.target.name} in {config.target.dtype}; {args.kind} heads of `{args.config}` drafting the "
             "trees named (total_token/depth/top_k) in the draft dtypes named; load average "
             "at the end {:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min; above 2, other work shared the cores and the "
             "ratios are noisy).".format(*os.getloadavg()), "",
             f"Serve's engine (`ContinuousBatcher`, no HTTP; drafting models under the per-sequence cost model, as "
             f"a replica serves them), a closed loop of N requests in flight over {len(prompts)} prompts (half "
             f"GSM8K, half MT-Bench first turns), {args.max_tokens} tokens each, T = 0; `gate off`: every batch "
             "drafts; `gate on`: `serve.measure_drafting` (the default), a batch drafts only where drafted steps "
             "measured faster at its size (a lone request: where its cost model says drafting pays). Runs "
             f"interleaved per concurrency, {args.repetitions} repetition(s); "
             "`same as plain`: outputs equal to plain decoding's, token for token.", "",
             md_table(["in flight", "model", "tree T/D/K", "draft dtype", "gate", "tok/s (mean)", "vs plain", "runs",
                       "drafted", "TTFT p50 ms", "same as plain"], rows), ""]
    atomic_write_text(Path(args.out), "\n".join(lines))
    print("\n".join(lines))
    return 0


def drafted_share(gate: DraftGate) -> float | None:
    """The share of the steps `gate` timed that drafted (None: it timed none, e.g. gate off or plain)."""
    drafted = sum(rate.steps for (_, kind), rate in gate.rates.items() if kind)
    total = sum(rate.steps for rate in gate.rates.values())
    return drafted / total if total else None


if __name__ == "__main__":
    sys.exit(main())
