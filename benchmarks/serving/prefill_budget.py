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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from taps_ray.bench.prompts import first_turns  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.data.chat import render_ids  # noqa: E402
from taps_ray.decoding.continuous import ContinuousBatcher, Request  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.drafting.proposers import PlainDecoding  # noqa: E402
from taps_ray.fsio import atomic_write_text  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.markdown import md_table  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def closed_loop(model, stop_ids: list[int], prompts: list[list[int]], budget: int, concurrency: int,
                max_tokens: int) -> dict[str, float]:
    """Decode every prompt with `concurrency` in flight; tokens/s, TTFT and inter-token latency (seconds)."""
    batcher = ContinuousBatcher(model, stop_ids, concurrency, prefill_tokens=budget)
    finished, first, gaps, produced = [0], [], [], [0]

    def submit(prompt: list[int]) -> None:
        arrived, last = time.perf_counter(), [0.0]

        def on_tokens(tokens: list[int], _logprobs) -> None:
            now = time.perf_counter()
            if last[0]:
                gaps.append((now - last[0]) / len(tokens))
            else:
                first.append(now - arrived)
            last[0] = now
            produced[0] += len(tokens)

        request = Request(prompt=prompt, proposer=PlainDecoding(), params=SamplingParams(), max_tokens=max_tokens,
                          seed=0, ignore_eos=True)
        batcher.submit(request, on_tokens=on_tokens, on_done=lambda _: finished.__setitem__(0, finished[0] + 1))

    queue = list(prompts)
    start = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        submit(queue.pop(0))
    while finished[0] < len(prompts):
        batcher.step()
        while queue and len(prompts) - len(queue) - finished[0] < concurrency:
            submit(queue.pop(0))
    wall = time.perf_counter() - start
    return {"tok_s": produced[0] / wall, "ttft_p50": percentile(first, 0.5), "ttft_p99": percentile(first, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


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
    turns = first_turns(["gsm8k", "mt_bench"], args.prompts // 2, [], 0, config.resolved_data_dir())
    prompts = [render_ids(target.tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
               for _, text in turns]
    budgets = [int(b) for b in args.budgets.split(",")]
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in budgets}
    for repetition in range(args.repetitions):
        for budget in budgets:
            runs[budget].append(closed_loop(target.model, target.stop_token_ids, prompts, budget, args.concurrency,
                                            args.max_tokens))
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
