"""Batched verification inside a target worker, and the driver's pool of target workers and drafter actors.

`VerificationPool` is plain asyncio + the engine's `TargetBatch` (no Ray inside), so it is testable alone.
A *session* is the batch of prompts one drafter decodes together (one `run_loop`). Sessions with the same
sampling parameters share a *group*: one `TargetBatch` (one right-padded KV cache) holding all their
sequences, up to `max_batch` sequences. A drafter's `step(trees)` request is queued on its session; the
scheduler runs ONE `TargetBatch.step` over a group as soon as

  * every session of the group has submitted its trees, or
  * the submitted sequences reach `max_batch`, or
  * the oldest queued request of the group has waited `max_wait_ms`;

sessions that did not submit in time sit that step out: the submitted sessions' rows are copied out of the
shared cache, stepped as a batch of their own and written back (`step_rows`), so a late session costs no
padded rows in the forward and its cache, length and sampling generator stay untouched. A new session is
prefilled alone, then merged into a group with room (caches padded to one width and concatenated along the
batch); a closed or idle session is evicted (its rows dropped, the cache cropped). One forward runs at a
time per worker, in a worker thread, so requests keep arriving while the target computes.

`EvalPool` is the driver side: N `TargetWorker`s, D `DrafterActor`s (drafter i uses worker i mod N), cells
dispatched to idle drafters, written to the results store as they finish, retried when an actor dies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from taps_ray.spec.target_batch import Committed, TargetBatch
from taps_ray.spec.tree import DraftTree
from taps_ray.spec.verify import SamplingParams

log = logging.getLogger(__name__)


class SessionLost(RuntimeError):
    """The worker no longer holds this session (it restarted, or the session expired or was dropped)."""


# --- TargetBatch state surgery: merge two batches, keep a subset of rows ----------------------------------------


def _pad_width(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3])
    return torch.cat([tensor, pad], dim=2)


def merge_batches(into: TargetBatch, other: TargetBatch) -> None:
    """Append `other`'s sequences after `into`'s. Both must share the model and the sampling parameters.

    Slots beyond a sequence's length are never attended (the engine masks the context by `lengths`), so
    zero-padding the narrower cache keeps the invariant "cache width = longest sequence" and every value.
    """
    if into.params != other.params:
        raise ValueError("only batches with the same sampling parameters can share a forward")
    width = max(into.cache.get_seq_length(), other.cache.get_seq_length())
    for mine, theirs in zip(into.cache.layers, other.cache.layers, strict=True):
        mine.keys = torch.cat([_pad_width(mine.keys, width), _pad_width(theirs.keys, width)], dim=0)
        mine.values = torch.cat([_pad_width(mine.values, width), _pad_width(theirs.values, width)], dim=0)
    into.lengths = torch.cat([into.lengths, other.lengths])
    into.generators = [*into.generators, *other.generators]


def take_rows(batch: TargetBatch, rows: list[int]) -> TargetBatch:
    """A new batch holding copies of the caches of `rows` (their generators are shared, not copied)."""
    from transformers import DynamicCache

    index = torch.tensor(rows, dtype=torch.long)
    lengths = batch.lengths[index]
    width = int(lengths.max())
    sub = TargetBatch(batch.model, drop_finished=False)
    sub.params = batch.params
    sub.cache = DynamicCache(ddp_cache_data=[(l.keys[index, :, :width], l.values[index, :, :width]) for l in batch.cache.layers])
    sub.lengths = lengths.clone()
    sub.generators = [batch.generators[i] for i in rows]
    return sub


def put_rows(batch: TargetBatch, rows: list[int], sub: TargetBatch) -> None:
    """Write a stepped sub-batch (from `take_rows`) back into its rows; the other rows keep their caches."""
    index = torch.tensor(rows, dtype=torch.long)
    lengths = batch.lengths.clone()
    lengths[index] = sub.lengths
    width = int(lengths.max())
    sub_width = sub.cache.get_seq_length()
    for mine, theirs in zip(batch.cache.layers, sub.cache.layers, strict=True):
        for name in ("keys", "values"):
            full = _pad_width(getattr(mine, name), width)  # the width only grows: rows only gain tokens
            full[index, :, :sub_width] = getattr(theirs, name)
            setattr(mine, name, full)
    batch.lengths = lengths


def step_rows(batch: TargetBatch, rows: list[int], trees: list[DraftTree | None]) -> list[Committed | None]:
    """`batch.step` for the sequences `rows` only (trees in the same order); the others are not computed at all.

    Sitting out with tree None would still cost each of those sequences a padded row in the forward; here the
    submitted rows are copied out, stepped as their own batch and written back.
    """
    with torch.no_grad():
        if rows == list(range(batch.batch_size)):
            return batch.step(trees)
        sub = take_rows(batch, rows)
        out = sub.step(trees)
        put_rows(batch, rows, sub)
        return out


def params_key(params: SamplingParams) -> str:
    return json.dumps(params.model_dump(), sort_keys=True)


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
    key: str
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


def _start(batch: TargetBatch, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Committed]:
    with torch.no_grad():
        return batch.start(prompts, params, seeds)


class VerificationPool:
    """Sessions of sequences on one target model, verified in batched forwards (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int = 8,
        max_wait_ms: float = 5.0,
        session_ttl_s: float = 600.0,
        merge: bool = True,
    ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.session_ttl = session_ttl_s
        self.merge = merge
        self.stats = PoolStats()
        self._groups: list[_Group] = []
        self._sessions: dict[str, _Session] = {}
        self._ids = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None

    # public API (called from the worker's event loop) ------------------------------------------------------

    async def start(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], owner: str = ""
    ) -> tuple[str, list[Committed]]:
        """Prefill a new session; returns its id and each sequence's first committed token."""
        self._ensure_running()
        loop = asyncio.get_running_loop()
        async with self._lock:
            batch = TargetBatch(self.model, drop_finished=False)
            committed = await loop.run_in_executor(self._executor, _start, batch, prompts, params, seeds)
            self.stats.prefills += 1
            key = params_key(params)
            group = None
            if self.merge:
                group = next((g for g in self._groups if g.key == key and g.rows + len(prompts) <= self.max_batch), None)
            if group is not None:
                await loop.run_in_executor(self._executor, merge_batches, group.batch, batch)
                self.stats.merged_sessions += 1
            else:
                group = _Group(batch, key)
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
                results = await loop.run_in_executor(self._executor, step_rows, group.batch, rows, trees)
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


# --- the driver's pool of actors ---------------------------------------------------------------------------


def is_retryable(error: BaseException) -> bool:
    """An actor died (or restarted under a running cell), or its node died with the cell's finished result
    still in that node's object store: the cell is worth another attempt."""
    import ray.exceptions

    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError, SessionLost))


CellHook = Callable[..., None]


@dataclass
class EvalReport:
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    retries: int = 0
    seconds: float = 0.0
    worker_stats: list[dict] = field(default_factory=list)


class EvalPool:
    """N target workers and D drafter actors; `run(cells, store)` evaluates cells through them.

    Use as a context manager (the actors are killed on exit, also when a hook raises).
    """

    def __init__(self, config, heads: dict | None = None, env: dict[str, str] | None = None) -> None:
        import ray

        from taps_ray.cluster.actors import TargetWorker, process_runtime_env, runtime_env_vars

        self.config = config
        r = config.ray
        env = {**runtime_env_vars(), **(env or {})}
        payload = config.model_dump_json()
        restarts = dict(max_restarts=r.actor_max_restarts, max_task_retries=0, runtime_env=process_runtime_env())
        self._restarts = restarts
        self.workers = [
            TargetWorker.options(
                num_cpus=r.target_num_cpus, num_gpus=r.target_num_gpus, resources=r.target_resources, max_concurrency=1000, **restarts
            ).remote(payload, env)
            for _ in range(r.num_target_workers)
        ]
        heads_ref = ray.put(heads or {})
        self._drafter_args = [
            (payload, self.workers[i % len(self.workers)], f"drafter-{i}-{id(self)}", heads_ref, env)
            for i in range(r.num_drafters)
        ]
        self.drafters = [self._new_drafter(args) for args in self._drafter_args]

    def __enter__(self) -> "EvalPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        import ray

        for actor in [*self.drafters, *self.workers]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.drafters, self.workers = [], []

    def ready(self, timeout: float | None = None) -> None:
        import ray

        ray.get([a.ping.remote() for a in [*self.workers, *self.drafters]], timeout=timeout)

    def worker_stats(self) -> list[dict]:
        import ray

        try:
            return ray.get([w.stats.remote() for w in self.workers], timeout=30)
        except Exception as error:  # stats are a nicety
            return [{"error": repr(error)}]

    def run(
        self,
        cells: list,
        store,
        on_cell_done: CellHook | None = None,
        on_submit: CellHook | None = None,
        log_line: Callable[[str], None] = print,
        meta: dict | None = None,
    ) -> EvalReport:
        """Evaluate `cells` (skip none: the caller filters finished ones); each finished cell is written to
        `store` at once. `on_submit(cell, attempt, drafter)` and `on_cell_done(cell)` are test/progress hooks.
        """
        import ray

        report = EvalReport()
        start = time.perf_counter()
        queue: list[tuple[Any, int]] = [(cell, 0) for cell in cells]
        running: dict[Any, tuple[Any, int, Any]] = {}  # ref -> (cell, attempt, drafter)
        idle = list(self.drafters)
        total = len(cells)
        while queue or running:
            while queue and idle:
                cell, attempt = queue.pop(0)
                drafter = idle.pop(0)
                ref = drafter.run_cell.remote(cell.as_dict())
                running[ref] = (cell, attempt, drafter)
                if on_submit is not None:
                    on_submit(cell, attempt, drafter)
            ready, _ = ray.wait(list(running), num_returns=1)
            ref = ready[0]
            cell, attempt, drafter = running.pop(ref)
            try:
                steps, questions, info = ray.get(ref)
            except Exception as error:  # noqa: BLE001 - every failure is either retried or recorded
                idle.append(self._healthy(drafter))
                if is_retryable(error) and attempt < self.config.ray.max_cell_retries:
                    report.retries += 1
                    log_line(f"cell {cell.id}: actor died ({type(error).__name__}); retry {attempt + 1}")
                    queue.insert(0, (cell, attempt + 1))
                    continue
                text = f"{type(error).__name__}: {error}\n{''.join(traceback.format_exception(error))}"
                store.write_failure(cell, text, attempts=attempt + 1)
                report.failed.append(cell.id)
                log_line(f"cell {cell.id}: FAILED after {attempt + 1} attempt(s): {type(error).__name__}: {str(error)[:300]}")
                continue
            idle.append(drafter)
            store.write_cell(cell, steps, questions, meta={**(meta or {}), **info, "attempts": attempt + 1})
            report.done.append(cell.id)
            log_line(
                f"[{len(report.done) + len(report.failed)}/{total}] {cell.id}: {info.get('tokens', 0)} tokens "
                f"in {info.get('seconds', 0):.1f}s"
            )
            if on_cell_done is not None:
                on_cell_done(cell)
        report.seconds = time.perf_counter() - start
        report.worker_stats = self.worker_stats()
        return report

    def _reachable(self, actor, deadline: float) -> bool:
        """Wait until `actor` answers (it may be restarting); False when Ray gave up on it."""
        import ray

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                ray.get(actor.ping.remote(), timeout=left)
                return True
            except ray.exceptions.ActorUnavailableError:  # restarting: calls fail fast until it is back
                time.sleep(0.5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False

    def _healthy(self, drafter, timeout: float = 900.0):
        """After a failure: wait for the target workers to be back, then return the drafter, or a fresh one
        in its place when Ray gave up restarting it."""
        import ray

        deadline = time.monotonic() + timeout
        for worker in self.workers:
            if not self._reachable(worker, deadline):
                log.error("a target worker did not come back; its cells will fail")
        if self._reachable(drafter, deadline):
            return drafter
        try:
            ray.kill(drafter, no_restart=True)
        except Exception:  # already gone
            pass
        index = self.drafters.index(drafter)
        replacement = self._new_drafter(self._drafter_args[index])
        self.drafters[index] = replacement
        return replacement

    def _new_drafter(self, args: tuple):
        from taps_ray.cluster.actors import DrafterActor

        r = self.config.ray
        return DrafterActor.options(
            num_cpus=r.drafter_num_cpus, num_gpus=r.drafter_num_gpus, resources=r.drafter_resources, **self._restarts
        ).remote(*args)
