"""Tokens/s of several decoding methods timed on the same prompts, interleaved so a noisy machine slows them alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

Method = Callable[[list[int]], list[int]]


def time_interleaved(methods: dict[str, Method], prompts: list[list[int]],
                     repetitions: int) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """Each method's tokens/s over `repetitions` passes of `prompts` (after one untimed warm-up call each; the
    order rotates every repetition) and its outputs of the first pass, one per prompt."""
    names = list(methods)
    seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in names}
    with torch.no_grad():
        for name in names:
            methods[name](prompts[0])
        for repetition in range(repetitions):
            order = names[repetition % len(names):] + names[: repetition % len(names)]
            for name in order:
                for prompt in prompts:
                    start = time.perf_counter()
                    out = methods[name](prompt)
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += len(out)
                    if repetition == 0:
                        outputs[name].append(out)
    return {name: tokens[name] / seconds[name] for name in names}, outputs
