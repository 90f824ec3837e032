"""The replica's online adaptation, as the decode loop sees it: three calls (serve/scheduler.py `DecodeLoop`).

`on_submit(request)`: the batcher's `on_commit` for a recorded request of an adapted model, else None (so a
request that is not recorded, and every request with `serve.adapt` off, adds nothing to a step).
`on_done(request, result)`: the request's recording goes to the buffer, its head version counts the result (a
routed model's: every head over the steps it drafted, and the spawn rule).
`between_steps()`: at most every `poll_s`, each adapted model serves the store's current version (a swap or a
roll back; a routed model: per head, and its spawned heads added), on the decoding thread between two steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from taps_ray.adapt.record import Recorder, Recording
from taps_ray.adapt.routed import ServedRouted
from taps_ray.adapt.spawn import SpawnRule
from taps_ray.adapt.swap import LiveStats, ServedModel
from taps_ray.adapt.trainer_actor import model_buffer, model_heads, model_store
from taps_ray.config import StudyConfig
from taps_ray.decoding.continuous import OnCommit, Request, Result
from taps_ray.drafting.proposer import Proposer
from taps_ray.models.draft_head import DraftHead
from taps_ray.workdir import head_checkpoint

logger = logging.getLogger("ray.serve")


class AdaptMetrics(Protocol):
    """What adaptation reports (Serve's `ServeMetrics` is one; adapt sits below serve in the layers)."""

    def version_finished(self, model: str, version: int, tau: float, accepted: int, drafted: int, completion: int,
                         live_tau: float, buffer_tokens: int) -> None: ...

    def swapped(self, model: str, version: int, kind: str) -> None: ...

    def head_swapped(self, model: str, head: str, version: int, kind: str) -> None: ...


class ReplicaAdaptation:
    def __init__(self, cfg: StudyConfig, models: list[str], build: Callable[[str, DraftHead], Proposer],
                 install: Callable[[str, Proposer], None], metrics: AdaptMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, routed: dict[str, Proposer] | None = None) -> None:
        """`build(model, head)`: the served proposer of single-head `model` drafting with `head`; `routed`: the
        served proposer of each routed model among `models` (its heads are swapped and added inside it);
        `install(model, proposer)` puts a proposer in the replica's table. The current versions are served at once."""
        a, kind = cfg.serve.adapt, cfg.serve.head_kind
        self.poll_s, self.metrics, self.clock = a.poll_s, metrics, clock
        routed = routed or {}
        self.models = {
            m: ServedModel(m, model_store(cfg, kind, m), lambda head, m=m: build(m, head),
                           lambda proposer, m=m: install(m, proposer), a.rollback_requests, a.rollback_margin)
            for m in models if m not in routed
        }
        self.routed = {}
        for m, router in routed.items():
            heads = model_heads(cfg, kind, m)
            heads.ensure({h: head_checkpoint(cfg, kind, h) for h in router.head_names})
            rule = SpawnRule(a.spawn_below_tau, a.spawn_window, a.spawn_after) if a.spawn else None
            self.routed[m] = ServedRouted(m, heads, router, lambda proposer, m=m: install(m, proposer),
                                          a.rollback_requests, a.rollback_margin, rule)
        self.recorders = {m: Recorder(model_buffer(cfg, kind, m), a.sample, a.max_recorded_per_minute,
                                      a.flush_tokens, seed=cfg.train.seed + i) for i, m in enumerate(models)}
        self._recordings: dict[int, tuple[Request, Recorder, Recording]] = {}  # by id(request), kept alive here
        for served in self.models.values():
            served.poll()
        for router in self.routed.values():
            router.poll()
        self._polled = clock()

    def _served(self, request: Request) -> tuple[ServedModel, int] | None:
        for served in self.models.values():
            version = served.version_of(request.proposer)
            if version is not None:
                return served, version
        return None

    def _model_of(self, request: Request) -> str | None:
        """The adapted model whose served (or recently served) proposer `request` drafts with."""
        found = self._served(request)
        if found is not None:
            return found[0].name
        return next((m for m, r in self.routed.items() if r.versions_of(request.proposer) is not None), None)

    def on_submit(self, request: Request) -> OnCommit | None:
        model = self._model_of(request)
        if model is None:
            return None
        recorder = self.recorders[model]
        recording = recorder.start(request.prompt)
        if recording is None:
            return None
        self._recordings[id(request)] = (request, recorder, recording)
        return recording.on_commit

    def on_done(self, request: Request, result: Result) -> None:
        tag = None
        for routed in self.routed.values():
            tag = tag or routed.finished(request.proposer, result)
        kept = self._recordings.pop(id(request), None)
        if kept is not None:
            kept[1].finish(kept[2], result.error is None, tag)
        found = self._served(request)  # None once its version is two swaps old: it no longer counts
        if found is not None and result.error is None:
            served, version = found
            one = LiveStats.of(result)
            total = served.finished(version, one)
            if self.metrics is not None:
                self.metrics.version_finished(served.name, version, result.generation.tau, one.accepted, one.drafted,
                                              len(result.generation.tokens), total.tau,
                                              self.recorders[served.name].buffer_tokens)

    def between_steps(self) -> None:
        now = self.clock()
        if now - self._polled < self.poll_s:
            return
        self._polled = now
        for served in self.models.values():
            rolling_back = served.rollback_due is not None
            try:
                swapped = served.poll()
            except Exception:  # an unreadable version: keep serving the one loaded, try again at the next poll
                logger.exception("adapt %s: loading the current head version failed", served.name)
                continue
            if swapped and self.metrics is not None:
                self.metrics.swapped(served.name, served.version, "rollback" if rolling_back else "publish")
        for routed in self.routed.values():
            try:
                events = routed.poll()
            except Exception:  # as above: the router keeps the heads it has, the next poll tries again
                logger.exception("adapt %s: loading a head version or a spawned head failed", routed.name)
                continue
            for head, version, kind in events if self.metrics is not None else ():
                self.metrics.head_swapped(routed.name, head, version, kind)

    def versions(self) -> dict[str, int | dict[str, int]]:
        """The version each adapted model serves; a routed model's per head (its spawned heads included)."""
        return {**{m: s.version for m, s in self.models.items()},
                **{m: {h: s.version for h, s in r.served.items()} for m, r in self.routed.items()}}

    def flush(self) -> None:
        """Write every recorder's pending recordings now (shutdown, benchmarks)."""
        for future in [r.flush() for r in self.recorders.values()]:
            future.result()
