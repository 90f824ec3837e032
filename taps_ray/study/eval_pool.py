"""The driver's pool of actors: N `TargetWorker`s, D `DrafterActor`s (drafter i uses worker i mod N), cells
dispatched to idle drafters, written to the results store as they finish, retried when an actor dies.

Each worker and its drafters share one placement group (strategy PACK): Ray reserves their bundles together,
on one node when one has room, so a drafter's per-step round trip to its worker stays on that node. When a
node dies, Ray reschedules the bundles that were on it and restarts their actors there.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from taps_ray import ray_requests
from taps_ray.config import RayConfig, StudyConfig
from taps_ray.decoding.verification_pool import SessionLost
from taps_ray.ray_runtime import process_runtime_env
from taps_ray.study.actors import DrafterActor, TargetWorker

log = logging.getLogger(__name__)


def is_retryable(error: BaseException) -> bool:
    """An actor died (or restarted under a running cell), or its node died with the cell's finished result
    still in that node's object store: the cell is worth another attempt."""
    lost = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError, SessionLost)
    return isinstance(error, lost)


CellHook = Callable[..., None]
STRATEGY = "PACK"  # one node when one has room for the whole group, else as few as will hold it


def drafters_of(r: RayConfig, worker: int) -> list[int]:
    """The drafters that send their trees to target worker `worker` (drafter i uses worker i mod N)."""
    return list(range(worker, r.num_drafters, r.num_target_workers))


def worker_bundles(cfg: StudyConfig, num_drafters: int) -> list[dict[str, float]]:
    """The bundles of one worker's placement group: the worker's, then one per drafter of it, each exactly
    what its actor asks for (`ray_requests`: CPUs, GPUs, memory, custom resources)."""
    drafter = ray_requests.drafter(cfg).bundle()
    return [ray_requests.target_worker(cfg).bundle(), *[drafter] * num_drafters]


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
        """`env`: variables on top of the driver's `runtime.ENV_KEYS`, set in every actor's process."""
        self.config = config
        r = config.ray
        payload = config.model_dump_json()
        self._restarts = dict(max_restarts=r.actor_max_restarts, max_task_retries=0, runtime_env=process_runtime_env(env))
        self.groups = [
            placement_group(worker_bundles(config, len(drafters_of(r, w))), strategy=STRATEGY)
            for w in range(r.num_target_workers)
        ]
        self.workers = [
            TargetWorker.options(
                **ray_requests.target_worker(config).options(), max_concurrency=1000,
                scheduling_strategy=self._bundle(w, 0), **self._restarts,
            ).remote(payload)
            for w in range(r.num_target_workers)
        ]
        heads_ref = ray.put(heads or {})
        self._drafter_args = [
            (payload, self.workers[i % len(self.workers)], f"drafter-{i}-{id(self)}", heads_ref)
            for i in range(r.num_drafters)
        ]
        self.drafters = [self._new_drafter(i) for i in range(r.num_drafters)]

    def __enter__(self) -> "EvalPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        for actor in [*self.drafters, *self.workers]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.drafters, self.workers = [], []
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []

    def ready(self, timeout: float | None = None) -> None:
        ray.get([a.ping.remote() for a in [*self.workers, *self.drafters]], timeout=timeout)

    def _bundle(self, worker: int, index: int) -> PlacementGroupSchedulingStrategy:
        """Bundle `index` of worker `worker`'s placement group (0: the worker, 1 + k: its k-th drafter)."""
        return PlacementGroupSchedulingStrategy(self.groups[worker], placement_group_bundle_index=index)

    def worker_stats(self) -> list[dict]:
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
        replacement = self._new_drafter(index)  # into the bundle its predecessor freed
        self.drafters[index] = replacement
        return replacement

    def _new_drafter(self, index: int):
        r = self.config.ray
        worker = index % r.num_target_workers
        bundle = self._bundle(worker, 1 + drafters_of(r, worker).index(index))
        return DrafterActor.options(
            **ray_requests.drafter(self.config).options(), scheduling_strategy=bundle, **self._restarts,
        ).remote(*self._drafter_args[index])
