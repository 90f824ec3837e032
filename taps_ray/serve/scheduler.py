"""The replica's decode loop: asyncio around `ContinuousBatcher`, with backpressure, health and shutdown.

The replica's compute thread runs `batcher.step()` back to back while there is work, and the event loop keeps
answering (health checks, new requests, streams) meanwhile: it streams a step's tokens while the next step
computes, as vLLM's engine core keeps stepping while its API server streams. Updates posted together take one
wakeup of the loop (not one a sequence). Requests beyond
`max_queued` waiting ones are refused with `Overloaded` (the app answers 503 + Retry-After);
`check_health` raises when there is work but no step finished for `stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from taps_ray.compute_thread import compute_executor
from taps_ray.serve.metrics import ServeMetrics
from taps_ray.decoding.step import head_counts
from taps_ray.decoding.continuous import ContinuousBatcher, Request, Result, TokenLogprob
from taps_ray.decoding.draft_gate import StepRate

if TYPE_CHECKING:  # an annotation only: the replica builds it when serve.adapt is on
    from taps_ray.adapt.replica import ReplicaAdaptation

logger = logging.getLogger("ray.serve")


class Overloaded(Exception):
    """The replica's queue is full or it is shutting down; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Update:
    tokens: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class Ticket:
    """The event loop's handle on a submitted request: its final result, delivered on the event loop, and the
    batcher's cancel function. With an `updates` queue, each step's tokens arrive there as (index, Update), and
    (index, None) once the result is ready."""

    request: Request
    model: str
    result: asyncio.Future
    updates: asyncio.Queue | None = None
    index: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    last_token: float = 0.0
    leave: Callable[[], None] = lambda: None  # the batcher's cancel (`ContinuousBatcher.submit`)

    async def wait(self) -> Result:
        """The result; if the caller goes away (cancelled), the sequence leaves the batch at the next step."""
        try:
            return await asyncio.shield(self.result)
        except asyncio.CancelledError:
            self.cancel()
            raise

    def cancel(self) -> None:
        if not self.result.done():
            self.leave()


def head_steps(result: Result, head_names: list[str]) -> dict[str, int]:
    """Verification steps per head of one request (`step.head_counts`); empty for plain decoding."""
    return dict(head_counts(result.generation.steps, head_names)) if head_names else {}


class DecodeLoop:
    def __init__(self, batcher: ContinuousBatcher, max_queued: int, stall_timeout_s: float,
                 metrics: ServeMetrics | None = None, adapt: ReplicaAdaptation | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        """`adapt`: the replica's online adaptation (serve.adapt): it records sampled requests, counts finished
        ones per head version and swaps versions between steps; None: none of it. `executor`: the process's
        compute thread, which loaded the model (`compute_thread.compute_executor`); None: a new one."""
        self.batcher, self.max_queued, self.stall_timeout_s = batcher, max_queued, stall_timeout_s
        self.metrics, self.adapt = metrics, adapt
        self._executor = executor or compute_executor("taps-decode")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._stopping = False  # the compute thread ends its run of steps after the current one
        self._posted: deque[tuple[Callable[..., None], tuple]] = deque()  # calls from the compute thread
        self._flush_scheduled = False
        self.last_progress = time.monotonic()
        self.mean_step_s = 0.1

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, request: Request, model: str, updates: asyncio.Queue | None = None, index: int = 0) -> Ticket:
        """Queue a request (raises `Overloaded` when the queue is full or the replica is shutting down)."""
        if self._closing:
            raise Overloaded("this replica is shutting down; retry (another replica will answer)", 1)
        if self.batcher.waiting >= self.max_queued:
            wait = self.batcher.waiting / max(self.batcher.max_batch_size, 1) * self.mean_step_s
            raise Overloaded(f"the server is busy: {self.batcher.waiting} requests are waiting "
                             f"(serve.max_queued_requests={self.max_queued}); retry later", max(1, math.ceil(wait)))
        loop = asyncio.get_running_loop()
        ticket = Ticket(request, model, loop.create_future(), updates, index)

        def on_tokens(tokens: list[int], logprobs: list[TokenLogprob]) -> None:
            self._post(loop, self._tokens, ticket, Update(tokens, logprobs))

        def on_done(result: Result) -> None:
            self._post(loop, self._done, ticket, result)

        on_commit = self.adapt.on_submit(request) if self.adapt is not None else None
        ticket.leave = self.batcher.submit(request, on_tokens, on_done, on_commit)
        self._ensure_running()
        self._wake.set()
        return ticket

    def check_health(self) -> None:
        if self._task is not None and self._task.done() and not self._task.cancelled():
            raise RuntimeError(f"the decode loop died: {self._task.exception()!r}")
        idle = time.monotonic() - self.last_progress
        if self.batcher.busy and idle > self.stall_timeout_s:
            raise RuntimeError(f"the decode loop has {self.batcher.live} running and {self.batcher.waiting} waiting "
                               f"requests but finished no step for {idle:.0f} s (serve.stall_timeout_s)")

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503) from now on; return once the running and queued ones have finished, or after
        `timeout_s`."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while self.batcher.busy and time.monotonic() < deadline and self._task is not None and not self._task.done():
            await asyncio.sleep(0.05)

    async def shutdown(self, timeout_s: float) -> None:
        """Refuse new requests, let the running and queued ones finish for up to `timeout_s`, fail the rest."""
        await self.drain(timeout_s)
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.batcher.fail_all, "the replica shut down")
        await asyncio.sleep(0)  # deliver the failures scheduled by fail_all
        self._executor.shutdown(wait=False)

    # -- internals -------------------------------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wake = self._wake or asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="taps-decode-loop")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.batcher.busy:
                self._wake.clear()
                await self._wake.wait()
                self.last_progress = time.monotonic()  # idle time is not a stall
                continue
            await loop.run_in_executor(self._executor, self._steps, loop)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the compute thread: steps back to back while there is work. Awaiting each step from the event loop
        made the loop's streaming of a step's tokens (chunks for 16 sequences) a pause of the compute threads
        before the next step; here it overlaps that step."""
        while self.batcher.busy and not self._stopping:
            if self.adapt is not None:  # a published head version is loaded here, between two steps
                self.adapt.between_steps()
            start = time.perf_counter()
            try:
                self.batcher.step()
            finally:
                seconds, live, waiting = time.perf_counter() - start, self.batcher.live, self.batcher.waiting
                self._post(loop, self._stepped, seconds, live, waiting, dict(self.batcher.gate.rates))

    def _post(self, loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
        """From the compute thread: run `callback(*args)` on the event loop, in the order posted. One wakeup of
        the loop takes every call posted until it runs, not one wakeup a sequence's update."""
        self._posted.append((callback, args))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False  # before taking: a call posted from now on schedules a flush of its own
        while self._posted:
            callback, args = self._posted.popleft()
            callback(*args)

    def _stepped(self, seconds: float, live: int, waiting: int, rates: dict[tuple[int, bool], StepRate]) -> None:
        self.mean_step_s = 0.9 * self.mean_step_s + 0.1 * seconds
        self.last_progress = time.monotonic()
        if self.metrics is not None:
            self.metrics.step(live, waiting)
            self.metrics.gate_rates(rates)

    def _tokens(self, ticket: Ticket, update: Update) -> None:
        now = time.perf_counter()
        if self.metrics is not None:
            if ticket.last_token:
                self.metrics.tokens_added(ticket.model, len(update.tokens), now - ticket.last_token)
            else:
                self.metrics.first_token(ticket.model, now - ticket.arrived)
        ticket.last_token = now
        if ticket.updates is not None:
            ticket.updates.put_nowait((ticket.index, update))

    def _done(self, ticket: Ticket, result: Result) -> None:
        if self.metrics is not None and result.error is None:
            generation = result.generation
            self.metrics.finished(
                ticket.model, len(generation.prompt), len(generation.tokens), generation.tau,
                sum(s.accepted for s in generation.steps), head_steps(result, list(ticket.request.proposer.head_names)),
                time.perf_counter() - ticket.arrived,
            )
        if self.adapt is not None:
            try:
                self.adapt.on_done(ticket.request, result)
            except Exception:  # adaptation is best effort: the client gets its result whatever happens here
                logger.exception("online adaptation failed to take a finished request")
        if not ticket.result.done():
            ticket.result.set_result(result)
        if ticket.updates is not None:
            ticket.updates.put_nowait((ticket.index, None))
