"""Serve's engine under a closed loop of requests: a fixed number in flight, each replaced when it finishes.

Why: Serve's latency and throughput questions (how a prefill budget or the drafting gate trades time to first
token against the running sequences' pace) are questions about `ContinuousBatcher`, and timing it without HTTP
keeps Ray's proxy and the client out of the numbers. Every request decodes a fixed number of tokens (`ignore_eos`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from taps_ray.bench.prompts import first_turns
from taps_ray.config import StudyConfig
from taps_ray.data.chat import render_ids
from taps_ray.decoding.continuous import ContinuousBatcher, Request
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposer import Proposer


@dataclass
class LoopTimes:
    """What a closed loop measured: seconds to each request's first token (from its submission), per-token gaps of
    its later steps, tokens produced, the wall time and each request's tokens (to check them against greedy)."""

    first: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def mixed_prompts(config: StudyConfig, tokenizer: Any, count: int) -> list[list[int]]:
    """`count` chat prompts as token ids: half GSM8K, half MT-Bench first turns, rendered with the chat template."""
    turns = first_turns(["gsm8k", "mt_bench"], count // 2, [], 0, config.resolved_data_dir())
    return [render_ids(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
            for _, text in turns]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else float("nan")


def closed_loop(batcher: ContinuousBatcher, prompts: list[list[int]], proposer: Proposer, concurrency: int,
                max_tokens: int) -> LoopTimes:
    """Decode every prompt greedily through `batcher` with `concurrency` requests in flight."""
    times = LoopTimes(outputs=[[] for _ in prompts])
    finished = [0]

    def submit(index: int) -> None:
        arrived, last = time.perf_counter(), [0.0]

        def on_tokens(tokens: list[int], _logprobs: object) -> None:
            now = time.perf_counter()
            if last[0]:
                times.gaps.append((now - last[0]) / len(tokens))
            else:
                times.first.append(now - arrived)
            last[0] = now
            times.tokens += len(tokens)
            times.outputs[index] += tokens

        request = Request(prompt=prompts[index], proposer=proposer, params=SamplingParams(), max_tokens=max_tokens,
                          seed=0, ignore_eos=True)
        batcher.submit(request, on_tokens=on_tokens, on_done=lambda _: finished.__setitem__(0, finished[0] + 1))

    sent = min(concurrency, len(prompts))
    start = time.perf_counter()
    for index in range(sent):
        submit(index)
    while finished[0] < len(prompts):
        batcher.step()
        while sent < len(prompts) and sent - finished[0] < concurrency:
            submit(sent)
            sent += 1
    times.wall_s = time.perf_counter() - start
    return times
