"""Batched verification inside a target worker: the scheduler the `TargetWorker` actor holds.

`VerificationPool` is plain asyncio + the engine's `TargetBatch` (no Ray inside), so it is testable alone.
A *session* is the batch of prompts one drafter decodes together (one `run_loop`). Sessions whose proposers
draft from the same target layers (what one forward must share; each row keeps its own sampling parameters and
seed) share a *group*: one `TargetBatch` (one right-padded KV cache) holding all their
sequences, up to `max_batch` sequences. A drafter's `step(trees)` request is queued on its session; the
scheduler runs ONE `TargetBatch.step` with `rows` over a group as soon as

  * every session of the group has submitted its trees, or
  * the submitted sequences reach `max_batch`, or
  * the oldest queued request of the group has waited `max_wait_ms`;

sessions that did not submit in time sit that step out and keep their cache and length (`TargetBatch.step` with `rows`:
in place beside padded rows when most rows step, on a copy of the few rows' caches otherwise). A new session is
prefilled alone, then merged into a group with room (`TargetBatch.merge`); a closed or idle session is
evicted (`TargetBatch.keep_rows`). The pool only schedules: every cache edit is a `TargetBatch` method. One
forward runs at a time per worker, in a worker thread, so requests keep arriving while the target computes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from taps_ray.compute_thread import compute_executor
from taps_ray.decoding.target_batch import Committed, TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.tree import DraftTree

log = logging.getLogger(__name__)


class SessionLost(RuntimeError):
    """The worker no longer holds this session (it restarted, or the session expired or was dropped)."""


# --- the worker's batching core ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Session:
    sid: str
    owner: str
    size: int
    group: "_Group"
    last_active: float
    pending: list[DraftTree | None] | None = None
    future: asyncio.Future | None = None


@dataclass(eq=False)
class _Group:
    batch: TargetBatch
    feature_layers: tuple[int, ...]  # what its sessions' proposers draft from: all a shared forward must match
    sessions: list[_Session] = field(default_factory=list)
    since: float | None = None  # when its oldest queued request arrived

    @property
    def rows(self) -> int:
        return sum(s.size for s in self.sessions)


@dataclass
class PoolStats:
    forwards: int = 0  # batched verification forwards
    prefills: int = 0
    sessions: int = 0
    sequences_verified: int = 0  # sequences with a tree, summed over forwards
    rows_forwarded: int = 0  # batch rows of those forwards (finished sequences of a session included)
    tree_tokens: int = 0  # tree nodes verified
    committed_tokens: int = 0
    verify_s: float = 0.0
    merged_sessions: int = 0
    batch_histogram: dict[int, int] = field(default_factory=dict)  # sequences verified per forward -> count

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["mean_sequences_per_forward"] = self.sequences_verified / self.forwards if self.forwards else 0.0
        return out


class VerificationPool:
    """Sessions of sequences on one target model, verified in batched forwards (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int = 8,
        max_wait_ms: float = 5.0,
        session_ttl_s: float = 600.0,
        merge: bool = True,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the process's compute thread, which loaded the model (`compute_thread.compute_executor`);
        None: a new one."""
        self.model = model
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.session_ttl = session_ttl_s
        self.merge = merge
        self.stats = PoolStats()
        self._groups: list[_Group] = []
        self._sessions: dict[str, _Session] = {}
        self._ids = itertools.count()
        self._executor = executor or compute_executor("verify")
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None

    # public API (called from the worker's event loop) ------------------------------------------------------

    async def start(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], owner: str = "",
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[str, list[Committed]]:
        """Prefill a new session; returns its id and each sequence's first committed token. `feature_layers`:
        the target layers its proposer drafts from (EAGLE-3); only sessions with the same layers share a batch."""
        self._ensure_running()
        loop = asyncio.get_running_loop()
        async with self._lock:
            batch = TargetBatch(self.model, feature_layers=feature_layers)
            committed = await loop.run_in_executor(self._executor, batch.start, prompts, params, seeds)
            self.stats.prefills += 1
            layers, group = tuple(feature_layers), None
            if self.merge:
                group = next((g for g in self._groups
                              if g.feature_layers == layers and g.rows + len(prompts) <= self.max_batch), None)
            if group is not None:
                await loop.run_in_executor(self._executor, group.batch.merge, batch)
                self.stats.merged_sessions += 1
            else:
                group = _Group(batch, layers)
                self._groups.append(group)
            sid = f"s{next(self._ids)}"
            session = _Session(sid, owner, len(prompts), group, loop.time())
            group.sessions.append(session)
            self._sessions[sid] = session
            self.stats.sessions += 1
        return sid, committed

    async def step(self, sid: str, trees: list[DraftTree | None]) -> list[Committed | None]:
        """Queue this session's trees; resolves when the batched forward that verified them is done."""
        self._ensure_running()
        session = self._sessions.get(sid)
        if session is None:
            raise SessionLost(f"session {sid} is not held by this worker (restarted, expired or closed)")
        if len(trees) != session.size:
            raise ValueError(f"session {sid} has {session.size} sequences, got {len(trees)} trees")
        if session.future is not None and not session.future.done():
            raise RuntimeError(f"session {sid} already has a step in flight")
        loop = asyncio.get_running_loop()
        session.pending = list(trees)
        session.future = loop.create_future()
        session.last_active = loop.time()
        if session.group.since is None:
            session.group.since = session.last_active
        self._wake.set()
        return await session.future

    async def close(self, sid: str) -> None:
        self._ensure_running()
        async with self._lock:
            await self._evict([self._sessions[sid]] if sid in self._sessions else [])

    async def drop_owner(self, owner: str) -> int:
        """Close every session of one drafter (a restarted drafter calls this for its predecessor's)."""
        self._ensure_running()
        async with self._lock:
            doomed = [s for s in self._sessions.values() if s.owner == owner]
            await self._evict(doomed)
        return len(doomed)

    def describe(self) -> dict[str, Any]:
        return {
            **self.stats.as_dict(),
            "open_sessions": len(self._sessions),
            "groups": [g.rows for g in self._groups],
        }

    # scheduling -------------------------------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
        if self._scheduler is None or self._scheduler.done():
            if self._scheduler is not None and not self._scheduler.cancelled() and self._scheduler.exception():
                log.error("verification scheduler died: %r", self._scheduler.exception())
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    def _pick(self, now: float) -> tuple[_Group | None, float | None]:
        """The group to verify now (oldest request first), else how long until one is due."""
        due: list[tuple[float, _Group]] = []
        wait: float | None = None
        for group in self._groups:
            queued = [s for s in group.sessions if s.pending is not None]
            if not queued:
                continue
            since = group.since if group.since is not None else now
            if len(queued) == len(group.sessions) or sum(s.size for s in queued) >= self.max_batch or now - since >= self.max_wait:
                due.append((since, group))
            else:
                left = since + self.max_wait - now
                wait = left if wait is None else min(wait, left)
        if due:
            return min(due, key=lambda item: item[0])[1], None
        return None, wait

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = loop.time()
            await self._expire(now)
            group, wait = self._pick(now)
            if group is None:
                timeout = min(wait, self.session_ttl) if wait is not None else self.session_ttl
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=max(timeout, 0.0))
                except asyncio.TimeoutError:
                    pass
                continue
            await self._verify(group)

    async def _verify(self, group: _Group) -> None:
        loop = asyncio.get_running_loop()
        async with self._lock:
            if group not in self._groups:
                return
            submitted = [s for s in group.sessions if s.pending is not None]
            rows: list[int] = []
            trees: list[DraftTree | None] = []
            offset = 0
            for session in group.sessions:
                if session.pending is not None:
                    rows.extend(range(offset, offset + session.size))
                    trees.extend(session.pending)
                offset += session.size
            for session in submitted:
                session.pending = None
            group.since = None
            verified = [t for t in trees if t is not None]
            start = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, group.batch.step, trees, rows)
            except Exception as error:  # the group's cache may be half-updated: drop the whole group
                log.exception("verification failed; dropping %d sessions", len(group.sessions))
                for session in submitted:
                    if not session.future.done():
                        session.future.set_exception(error)
                await self._evict(list(group.sessions))
                return
            self.stats.verify_s += time.perf_counter() - start
            self.stats.forwards += 1
            self.stats.sequences_verified += len(verified)
            self.stats.rows_forwarded += len(trees)
            self.stats.tree_tokens += sum(t.size for t in verified)
            self.stats.committed_tokens += sum(len(r.tokens) for r in results if r is not None)
            histogram = self.stats.batch_histogram
            histogram[len(verified)] = histogram.get(len(verified), 0) + 1
            offset = 0
            now = loop.time()
            for session in submitted:  # results come in row order, session by session
                part = results[offset : offset + session.size]
                offset += session.size
                if not session.future.done():
                    session.last_active = now
                    session.future.set_result(part)

    async def _expire(self, now: float) -> None:
        idle = [
            s
            for s in self._sessions.values()
            if now - s.last_active > self.session_ttl and (s.future is None or s.future.done()) and s.pending is None
        ]
        if idle:
            log.warning("dropping %d sessions idle for more than %.0fs", len(idle), self.session_ttl)
            async with self._lock:
                await self._evict(idle)

    async def _evict(self, sessions: list[_Session]) -> None:
        """Remove sessions (caller holds the lock): their rows leave the group; an empty group is dropped."""
        loop = asyncio.get_running_loop()
        for session in sessions:
            if self._sessions.pop(session.sid, None) is None:
                continue
            if session.future is not None and not session.future.done():
                session.future.set_exception(SessionLost(f"session {session.sid} was closed"))
            group = session.group
            keep: list[int] = []
            offset = 0
            for other in group.sessions:
                if other is not session:
                    keep.extend(range(offset, offset + other.size))
                offset += other.size
            group.sessions.remove(session)
            if not group.sessions:
                if group in self._groups:
                    self._groups.remove(group)
                continue
            await loop.run_in_executor(self._executor, group.batch.keep_rows, keep)
            if not any(s.pending is not None for s in group.sessions):
                group.since = None
