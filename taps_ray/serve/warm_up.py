"""A replica's warm-up: the target's layer graph compiled before the replica takes traffic.

Why: with `target.compile` resolving to the layer graph (a CPU replica, models/layer_graph.py), the first forward
of each shape class (a one-token step of one row, of several) compiles for 20-40 s on two cores; a request
arriving first would wait that long, and the scheduler's stall watch could take it for a hung engine. So the
replica decodes a few tokens of a dummy prompt, alone and two at once, through its own batcher (with its
feature layers: every forward of a replica with heads returns them, plain steps too).
"""

from __future__ import annotations

import logging
import time

from taps_ray.decoding.continuous import ContinuousBatcher, Request
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposer import Proposer

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 3


def warm_up(batcher: ContinuousBatcher, plain: Proposer, prompt: list[int]) -> float:
    """Compile what serving runs (see the module docstring); returns the seconds it took. The batcher is left
    idle, as it was."""
    start = time.perf_counter()
    for copies in (1, 2):
        for _ in range(copies):
            batcher.submit(Request(prompt=list(prompt), proposer=plain, params=SamplingParams(),
                                   max_tokens=WARM_UP_TOKENS, seed=0, ignore_eos=True))
        while batcher.busy:
            batcher.step()
    seconds = time.perf_counter() - start
    logger.info("taps serve: the target's layer graph compiled in %.0f s (warm-up)", seconds)
    return seconds
