"""The replica's decode loop without Ray Serve: backpressure, stall detection, shutdown, per-step updates."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from taps_ray.decoding.continuous import ContinuousBatcher, Request
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposers import PlainDecoding
from taps_ray.serve.scheduler import DecodeLoop, Overloaded


class Gated(PlainDecoding):
    """Plain decoding whose drafting waits for a gate: a decode step that makes no progress."""

    drafts = True  # a proposer the loop calls each step (plain decoding's root-only trees are made without a call)

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.gate, self.timeout_s = threading.Event(), timeout_s

    def propose(self, state, features, next_tokens):
        self.gate.wait(timeout=self.timeout_s)
        return super().propose(state, features, next_tokens)


def _request(prompt: list[int], proposer, n: int) -> Request:
    return Request(prompt=prompt, proposer=proposer, params=SamplingParams(), max_tokens=n, seed=0)


def test_queue_limit_stall_detection_and_shutdown(tiny_target):
    prompt = tiny_target.tokenizer.encode("Hello there")

    async def scenario() -> None:
        gated = Gated()
        batcher = ContinuousBatcher(tiny_target.model, [], max_batch_size=1)
        loop = DecodeLoop(batcher, max_queued=1, stall_timeout_s=0.3)
        updates: asyncio.Queue = asyncio.Queue()
        running = loop.submit(_request(prompt, gated, 6), "gated", updates)
        await asyncio.sleep(0.5)  # admitted (prefilled), now stuck drafting its first tree
        assert batcher.live == 1 and batcher.waiting == 0
        with pytest.raises(RuntimeError, match="finished no step"):
            loop.check_health()
        queued = loop.submit(_request(prompt, PlainDecoding(), 3), "plain")
        with pytest.raises(Overloaded, match="max_queued_requests=1") as refused:
            loop.submit(_request(prompt, PlainDecoding(), 3), "plain")
        assert refused.value.retry_after_s >= 1
        gated.gate.set()
        first, second = await running.wait(), await queued.wait()
        assert len(first.generation.tokens) == 6 and len(second.generation.tokens) == 3
        loop.check_health()  # progress again
        streamed = []
        while (item := updates.get_nowait())[1] is not None:
            streamed += item[1].tokens
        assert streamed == first.generation.tokens  # one update per step, then the end marker
        late = loop.submit(_request(prompt, Gated(timeout_s=1.0), 20), "gated")  # too slow: shutdown fails it
        await loop.shutdown(timeout_s=0.2)
        assert (await late.wait()).error == "RuntimeError: the replica shut down"
        with pytest.raises(Overloaded, match="shutting down"):
            loop.submit(_request(prompt, PlainDecoding(), 3), "plain")

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_steps_go_on_while_the_event_loop_is_busy(tiny_target):
    """The compute thread steps back to back: a request decodes to its end while the event loop is blocked (a
    slow stream), and its updates then arrive in step order, one a step."""
    prompt = tiny_target.tokenizer.encode("Hello there")

    async def scenario() -> None:
        batcher = ContinuousBatcher(tiny_target.model, [], max_batch_size=2)
        loop = DecodeLoop(batcher, max_queued=4, stall_timeout_s=60.0)
        updates: asyncio.Queue = asyncio.Queue()
        ticket = loop.submit(_request(prompt, Gated(timeout_s=0.05), 12), "gated", updates)  # 50 ms a step
        await asyncio.sleep(0.01)  # the decode task hands the work to the compute thread
        delivered = updates.qsize()
        deadline = time.monotonic() + 10
        while batcher.busy and time.monotonic() < deadline:
            time.sleep(0.01)  # blocks the event loop itself: no coroutine runs meanwhile
        assert not batcher.busy, "the compute thread stopped stepping while the event loop was busy"
        assert updates.qsize() == delivered < 12  # updates are delivered on the loop, which has not run since
        result = await ticket.wait()
        streamed = []
        while (item := updates.get_nowait())[1] is not None:
            assert len(item[1].tokens) == 1  # plain decoding: a token a step
            streamed += item[1].tokens
        assert len(result.generation.tokens) == 12 and streamed == result.generation.tokens
        await loop.shutdown(timeout_s=1.0)

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
