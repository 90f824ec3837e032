"""Training beside serving: continue the served head on the recorded traffic, publish only what is better.

`OnlineTrainer.round` (plain PyTorch, testable without Ray): once `min_new_tokens` new positions are buffered,
split the buffer by recency (the newest `heldout_fraction` of its sequences is held out: the traffic the next
version will meet), run `steps_per_round` optimizer steps of the project's own loss (`losses.run_passes`,
`LossSettings.for_kind`: EAGLE-2's, HASS's or EAGLE-3's) on the rest, then score the candidate and the served
version on the held-out traffic with the trainer's `evaluate` (top-1 agreement with the target). The candidate is
published only when its agreement beats the served version's by more than `min_gain`, and only if that version
still serves. The candidate keeps its weights and optimizer across rounds (training continues); when the served
version changes under it (a roll back), it restarts from the served one.

A routed model (`RoutedTrainer`) trains each of its heads the same way on the traffic routed to it (its buffer's
sequences tagged with that head: versions per model and head, `heads.HeadSet`), and, when a replica asks, spawns a
head for the traffic none does well on (`spawner.Spawner`); all its trainers share one `TargetSide`.

`OnlineTrainerActor` is the Ray actor around either, with its own CPUs (`serve.adapt.trainer_num_cpus`, also its torch
threads): `run` loops rounds until `stop`; `pause`, `resume` and `train_for` (rounds back to back) let a benchmark
measure what training costs serving.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from taps_ray.adapt.buffer import Tag, TrafficBuffer
from taps_ray.adapt.candidate import Candidate, TargetSide
from taps_ray.adapt.heads import HeadEntry, HeadSet
from taps_ray.adapt.spawner import Spawner, SpawnRound
from taps_ray.adapt.versions import VersionStore
from taps_ray.config import ROUTED_ADAPT, StudyConfig, parse_config
from taps_ray.models.draft_head import DraftHead
from taps_ray.workdir import head_checkpoint


def adapt_root(cfg: StudyConfig, kind: str, model: str):
    """Where one adapted model's buffer and versions live: <work_dir>/<serve.adapt.dir>/<kind>-<model>/."""
    return cfg.work_path(cfg.serve.adapt.dir, f"{kind}-{model}")


def model_store(cfg: StudyConfig, kind: str, model: str) -> VersionStore:
    return VersionStore(adapt_root(cfg, kind, model) / "versions", head_checkpoint(cfg, kind, model))


def model_buffer(cfg: StudyConfig, kind: str, model: str) -> TrafficBuffer:
    a = cfg.serve.adapt
    return TrafficBuffer(adapt_root(cfg, kind, model) / "buffer", a.buffer_tokens, a.max_age_s)


def model_heads(cfg: StudyConfig, kind: str, model: str) -> HeadSet:
    """A routed model's heads and their versions (under its adapt root)."""
    return HeadSet(adapt_root(cfg, kind, model), cfg.serve.adapt.max_heads)


@dataclass
class RoundResult:
    served: int  # the version scored against
    candidate_acc: float
    served_acc: float
    published: int | None  # the new version, or None: the candidate did not beat the served one
    train_sequences: int
    heldout_sequences: int
    seconds: float
    head: str | None = None  # a routed model's head this round trained (None: a single-head model)


class OnlineTrainer:
    def __init__(self, cfg: StudyConfig, model: str, kind: str | None = None, side: TargetSide | None = None,
                 head: tuple[HeadEntry, VersionStore] | None = None) -> None:
        """`head`: one head of routed `model` and its store; it trains on the sequences routed to it only."""
        self.cfg, self.model = cfg, model
        self.kind = kind or cfg.serve.head_kind
        self.adapt = cfg.serve.adapt
        self.side = side or TargetSide(cfg, self.kind)
        self.head_name = head[0].name if head else None
        self.store = head[1] if head else model_store(cfg, self.kind, model)
        self.buffer = model_buffer(cfg, self.kind, model)
        self.where: Callable[[Tag], bool] | None = None if head is None else self._routed_here
        self.seen: set[str] = set()  # shards some round has read
        self._start_from(self.store.current().number)

    def _routed_here(self, tag: Tag) -> bool:
        return tag.get("head") == self.head_name

    def _start_from(self, number: int) -> None:
        """The candidate restarts from the served version `number`, with a fresh optimizer."""
        self.base = number
        self.candidate = Candidate(self.cfg, self.store.version(number).path)

    def round(self, force: bool = False) -> RoundResult | None:
        """One round, or None while fewer than `min_new_tokens` positions arrived since the last one (`force`:
        train on what is there anyway) or the buffer holds fewer than two sequences."""
        shards = self.buffer.shards()
        if not force and sum(s.tokens for s in shards if s.file not in self.seen) < self.adapt.min_new_tokens:
            return None
        start = time.perf_counter()
        self.seen = {s.file for s in shards}
        served = self.store.current()
        if served.number != self.base:
            self._start_from(served.number)
        examples = [self.side.with_topk(e) for e in self.buffer.read(shards, self.where) if int(e.loss_mask.sum()) > 0]
        if len(examples) < 2:
            return None
        train, held = self.side.split(examples)
        self.side.train(self.candidate, train)
        served_acc = self.side.agreement(DraftHead.load(served.path), held)
        candidate_acc = self.side.agreement(self.candidate.head, held)
        published = None
        if candidate_acc > served_acc + self.adapt.min_gain:
            metrics = {"heldout_acc": candidate_acc, "served_acc": served_acc, "heldout_sequences": len(held)}
            version = self.store.publish(self.candidate.head, metrics, over=served.number)
            if version is None:  # rolled back while this round trained: start again from what serves now
                self._start_from(self.store.current().number)
            else:
                published = self.base = version.number
        return RoundResult(served.number, candidate_acc, served_acc, published, len(train), len(held),
                           time.perf_counter() - start, self.head_name)

    def train_round(self, force: bool) -> list[RoundResult | SpawnRound]:
        result = self.round(force)
        return [result] if result is not None else []


class RoutedTrainer:
    """A routed model's trainers: one per head (spawned heads joining as they come) and the spawner."""

    def __init__(self, cfg: StudyConfig, model: str, kind: str | None = None) -> None:
        self.cfg, self.model = cfg, model
        self.kind = kind or cfg.serve.head_kind
        self.side = TargetSide(cfg, self.kind)
        self.heads = model_heads(cfg, self.kind, model)
        self.trainers: dict[str, OnlineTrainer] = {}
        self.spawner = Spawner(self.heads, model_buffer(cfg, self.kind, model), self.side)

    def train_round(self, force: bool) -> list[RoundResult | SpawnRound]:
        """A round for every head (as `OnlineTrainer.round`), then one of the pending spawn if any."""
        for entry in self.heads.heads():
            if entry.name not in self.trainers:
                self.trainers[entry.name] = OnlineTrainer(self.cfg, self.model, self.kind, self.side,
                                                          (entry, self.heads.store(entry)))
        results: list[RoundResult | SpawnRound] = [r for t in self.trainers.values() for r in t.train_round(force)]
        spawned = self.spawner.round()
        return results + ([spawned] if spawned is not None else [])


class OnlineTrainerActor:
    """The Ray actor (`start_trainer`): rounds in a loop on its own CPUs, beside the replicas."""

    def __init__(self, config: dict[str, Any], model: str, kind: str | None = None) -> None:
        cfg = parse_config(config, "<online trainer>")
        torch.set_num_threads(max(1, math.ceil(cfg.serve.adapt.trainer_num_cpus)))
        routed = model in ROUTED_ADAPT
        self.trainer = RoutedTrainer(cfg, model, kind) if routed else OnlineTrainer(cfg, model, kind)
        self.history: list[dict[str, Any]] = []
        self._running = threading.Event()
        self._running.set()
        self._stop = threading.Event()
        self._looping = threading.Lock()
        self._training = threading.Lock()  # one round at a time, whoever asks

    def run(self, idle_s: float = 1.0) -> int:
        """Rounds until `stop` (one loop: a second call returns at once); returns the rounds run."""
        if not self._looping.acquire(blocking=False):
            return len(self.history)
        while not self._stop.is_set():
            self._running.wait(timeout=idle_s)
            results = self._round(force=False) if self._running.is_set() else []
            if not results:
                self._stop.wait(idle_s)
        return len(self.history)

    def train_for(self, seconds: float) -> int:
        """Rounds back to back for `seconds`, new traffic or not; returns how many ran."""
        end, rounds = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            rounds += len(self._round(force=True))
        return rounds

    def _round(self, force: bool) -> list[RoundResult | SpawnRound]:
        with self._training:
            started = time.time()
            results = self.trainer.train_round(force)
        for result in results:
            self.history.append({**asdict(result), "started": started, "ended": time.time()})
        return results

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()

    def rounds(self) -> list[dict[str, Any]]:
        return list(self.history)


def start_trainer(cfg: StudyConfig, model: str, kind: str | None = None) -> Any:
    """The model's trainer actor (one per cluster: a named actor, reused when another replica started it), running."""
    import ray

    kind = kind or cfg.serve.head_kind
    actor = ray.remote(OnlineTrainerActor).options(
        name=f"taps-adapt-{kind}-{model}", get_if_exists=True, num_cpus=cfg.serve.adapt.trainer_num_cpus,
        max_concurrency=4,  # `run` holds one thread; pause, resume, stop and rounds answer on the others
    ).remote(cfg.model_dump(mode="json"), model, kind)
    actor.run.remote()
    return actor
