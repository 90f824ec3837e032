"""A replica's warm-up: the target's layer graph compiled before the replica takes traffic.

Why: with `target.compile` resolving to the layer graph (a CPU replica, models/layer_graph.py), the first forward
of each shape class (a one-token step of one row, of several; a row of any width) compiles for 20-40 s on two
cores; a request arriving first would wait that long, and the scheduler's stall watch could take it for a hung
engine. So the replica decodes a few tokens of a dummy prompt, alone and two at once, through its own batcher
(with its feature layers: every forward of a replica with heads returns them, plain steps too).
Then it prefills one prompt at each width the layer graph pads a row to (`LayerGraph.prefill_width`) up to
`WARM_PREFILL_TOKENS`: oneDNN builds a matmul's kernels for each row count on its first use, ~15 ms of a first
request's prefill (models/layer_graph.py); the batch's trees, packed into a row, run at those widths too.
"""

from __future__ import annotations

import logging
import time

from taps_ray.decoding.continuous import ContinuousBatcher, Request
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposer import Proposer
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.target_forward import target_forward

logger = logging.getLogger(__name__)

# under a prefill budget the second of two requests joins the first's second step; with 4 tokens the first is
# still decoding after it, so a step of two rows runs and compiles. With 3, a warm-up prompt over half the
# budget (the benchmarks' real prompts; not the replica's short one) ran none, and the first two requests to
# overlap waited ~30 s for that graph (bf16, AMD EPYC)
WARM_UP_TOKENS = 4
# prompts up to this long find their prefill's kernels built (SmolLM2 on 2 cores: ~4 s in bf16, ~10 s in fp32)
WARM_PREFILL_TOKENS = 512


def warm_up(batcher: ContinuousBatcher, plain: Proposer, prompt: list[int]) -> float:
    """Compile what serving runs (see the module docstring); returns the seconds it took (0 for a forward that
    compiles nothing, which needs no warm-up). The batcher is left idle, as it was."""
    if not target_forward(batcher.model).compiled:
        return 0.0
    start = time.perf_counter()
    for copies in (1, 2):
        _decode(batcher, [Request(prompt=list(prompt), proposer=plain, params=SamplingParams(),
                                  max_tokens=WARM_UP_TOKENS, seed=0, ignore_eos=True) for _ in range(copies)])
    compiled = time.perf_counter()
    logger.info("taps serve: the target's layer graph compiled in %.0f s (warm-up)", compiled - start)
    forward = target_forward(batcher.model)
    if isinstance(forward, FastLlama) and forward.graph is not None:
        widths = sorted({forward.graph.prefill_width(n) for n in range(2, WARM_PREFILL_TOKENS + 1)})
        for width in widths:
            _decode(batcher, [Request(prompt=(prompt * width)[:width], proposer=plain, params=SamplingParams(),
                                      max_tokens=1, seed=0, ignore_eos=True)])
        logger.info("taps serve: prefills at %d widths up to %d tokens warmed in %.0f s (warm-up)", len(widths),
                    WARM_PREFILL_TOKENS, time.perf_counter() - compiled)
    return time.perf_counter() - start


def _decode(batcher: ContinuousBatcher, requests: list[Request]) -> None:
    for request in requests:
        batcher.submit(request)
    while batcher.busy:
        batcher.step()
