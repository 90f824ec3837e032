"""The replica's online adaptation, as the decode loop sees it: three calls (serve/scheduler.py `DecodeLoop`).

`on_submit(request)`: the batcher's `on_commit` for a recorded request of an adapted model, else None (so a
request that is not recorded, and every request with `serve.adapt` off, adds nothing to a step).
`on_done(request, result)`: the request's recording goes to the buffer, its head version counts the result.
`between_steps()`: at most every `poll_s`, each adapted model serves the store's current version (a swap or a
roll back), on the decoding thread between two steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from taps_ray.adapt.record import Recorder, Recording
from taps_ray.adapt.swap import LiveStats, ServedModel
from taps_ray.adapt.trainer_actor import model_buffer, model_store
from taps_ray.config import StudyConfig
from taps_ray.decoding.continuous import OnCommit, Request, Result
from taps_ray.drafting.proposer import Proposer
from taps_ray.models.draft_head import DraftHead
from taps_ray.serve.metrics import ServeMetrics

logger = logging.getLogger("ray.serve")


class ReplicaAdaptation:
    def __init__(self, cfg: StudyConfig, models: list[str], build: Callable[[str, DraftHead], Proposer],
                 install: Callable[[str, Proposer], None], metrics: ServeMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`build(model, head)`: the served proposer of `model` drafting with `head`; `install(model, proposer)`
        puts it in the replica's table. The current versions are served at once."""
        a, kind = cfg.serve.adapt, cfg.serve.head_kind
        self.poll_s, self.metrics, self.clock = a.poll_s, metrics, clock
        self.models = {
            m: ServedModel(m, model_store(cfg, kind, m), lambda head, m=m: build(m, head),
                           lambda proposer, m=m: install(m, proposer), a.rollback_requests, a.rollback_margin)
            for m in models
        }
        self.recorders = {m: Recorder(model_buffer(cfg, kind, m), a.sample, a.max_recorded_per_minute,
                                      a.flush_tokens, seed=cfg.train.seed + i) for i, m in enumerate(models)}
        self._recordings: dict[int, tuple[Request, Recording]] = {}
        for served in self.models.values():
            served.poll()
        self._polled = clock()

    def _served(self, request: Request) -> tuple[ServedModel, int] | None:
        for served in self.models.values():
            version = served.version_of(request.proposer)
            if version is not None:
                return served, version
        return None

    def on_submit(self, request: Request) -> OnCommit | None:
        found = self._served(request)
        if found is None:
            return None
        recording = self.recorders[found[0].name].start(request.prompt)
        if recording is None:
            return None
        self._recordings[id(request)] = (request, recording)
        return recording.on_commit

    def on_done(self, request: Request, result: Result) -> None:
        kept = self._recordings.pop(id(request), None)
        found = self._served(request)
        if found is None:
            return
        served, version = found
        recorder = self.recorders[served.name]
        if kept is not None:
            recorder.finish(kept[1], result.error is None)
        if result.error is None:
            one = LiveStats.of(result)
            total = served.finished(version, one)
            if self.metrics is not None:
                self.metrics.version_finished(served.name, version, result.generation.tau, one.accepted, one.drafted,
                                              len(result.generation.tokens), total.tau, recorder.buffer.tokens)

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

    def flush(self) -> None:
        """Write every recorder's pending recordings now (shutdown, benchmarks)."""
        for future in [r.flush() for r in self.recorders.values()]:
            future.result()
