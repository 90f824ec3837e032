#!/usr/bin/env python
"""What `serve.prefill_tokens` trades: time to first token against the running sequences' inter-token latency.
Not a test.

    python benchmarks/serving/prefill_budget.py --config configs/data_size.yaml --budgets 2048,512,256 \
        --out reports/prefill_budget.md

Serve's engine without HTTP (`ContinuousBatcher`, plain decoding): a closed loop keeps `--concurrency` requests in
flight over `--prompts` prompts (half GSM8K, half MT-Bench first turns), each decoding `--max-tokens` tokens
(`ignore_eos`), and times every request's first token (from its submission) and each later step's tokens. The
budgets run in turn, `--repetitions` times interleaved, in one process: read the ratios, not the absolute speeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from taps_ray.bench.closed_loop import closed_loop, mixed_prompts, percentile  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.decoding.continuous import ContinuousBatcher  # noqa: E402
from taps_ray.drafting.proposers import PlainDecoding  # noqa: E402
from taps_ray.fsio import atomic_write_text  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.markdown import md_table  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/data_size.yaml")
    parser.add_argument("--budgets", default="2048,512,256")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="reports/prefill_budget.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    target = load_target(config.target)
    prompts = mixed_prompts(config, target.tokenizer, args.prompts)
    budgets = [int(b) for b in args.budgets.split(",")]
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in budgets}
    for repetition in range(args.repetitions):
        for budget in budgets:
            batcher = ContinuousBatcher(target.model, target.stop_token_ids, args.concurrency, prefill_tokens=budget)
            times = closed_loop(batcher, prompts, PlainDecoding(), args.concurrency, args.max_tokens)
            runs[budget].append({"tok_s": times.tokens_per_s, "ttft_p50": percentile(times.first, 0.5),
                                 "ttft_p99": percentile(times.first, 0.99), "itl_p50": percentile(times.gaps, 0.5),
                                 "itl_p99": percentile(times.gaps, 0.99)})
            print(f"repetition {repetition} budget {budget}: {runs[budget][-1]}", flush=True)
    rows = []
    for budget in budgets:
        mean = {key: statistics.mean(run[key] for run in runs[budget]) for key in runs[budget][0]}
        rows.append([str(budget), f"{mean['tok_s']:.1f}", f"{mean['ttft_p50'] * 1000:.0f} / {mean['ttft_p99'] * 1000:.0f}",
                     f"{mean['itl_p50'] * 1000:.0f} / {mean['itl_p99'] * 1000:.0f}"])
    command = "python benchmarks/serving/prefill_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Serve's prefill budget: first tokens against the running sequences' latency", "",
             f"Regenerate: `{command}`. Machine: {cpu_line()}; {args.threads} torch threads; target "
             f"{config.target.name} in {config.target.dtype}.", "",
             f"Serve's engine (`ContinuousBatcher`, plain decoding, no HTTP), {args.concurrency} requests in flight "
             f"over {len(prompts)} prompts (half GSM8K, half MT-Bench first turns), {args.max_tokens} tokens each; "
             f"the mean of {args.repetitions} interleaved repetitions per budget (`serve.prefill_tokens`: prompt "
             "tokens prefilled per scheduling iteration).", "",
             md_table(["prefill_tokens", "tok/s", "TTFT p50 / p99 ms", "inter-token p50 / p99 ms"], rows), ""]
    atomic_write_text(Path(args.out), "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
