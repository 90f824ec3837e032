"""Training beside serving: continue the served head on the recorded traffic, publish only what is better.

`OnlineTrainer.round` (plain PyTorch, testable without Ray): once `min_new_tokens` new positions are buffered,
split the buffer by recency (the newest `heldout_fraction` of its sequences is held out: the traffic the next
version will meet), run `steps_per_round` optimizer steps of the project's own loss (`losses.run_passes`,
`LossSettings.for_kind`: EAGLE-2's, HASS's or EAGLE-3's) on the rest, then score the candidate and the served
version on the held-out traffic with the trainer's `evaluate` (top-1 agreement with the target). The candidate is
published only when its agreement beats the served version's by more than `min_gain`, and only if that version
still serves. The candidate keeps its weights and optimizer across rounds (training continues); when the served
version changes under it (a roll back), it restarts from the served one.

`OnlineTrainerActor` is the Ray actor around it, with its own CPUs (`serve.adapt.trainer_num_cpus`, also its torch
threads): `run` loops rounds until `stop`; `pause`, `resume` and `train_for` (rounds back to back) let a benchmark
measure what training costs serving.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from taps_ray.adapt.buffer import TrafficBuffer
from taps_ray.adapt.versions import VersionStore
from taps_ray.config import StudyConfig, parse_config
from taps_ray.data.draft_vocab import draft_vocabulary
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.draft_parts import load_training_target
from taps_ray.training.features import PROBS_DTYPE, Example
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes
from taps_ray.training.trainer import collate, evaluate
from taps_ray.workdir import head_checkpoint


def adapt_root(cfg: StudyConfig, kind: str, model: str):
    """Where one adapted model's buffer and versions live: <work_dir>/<serve.adapt.dir>/<kind>-<model>/."""
    return cfg.work_path(cfg.serve.adapt.dir, f"{kind}-{model}")


def model_store(cfg: StudyConfig, kind: str, model: str) -> VersionStore:
    return VersionStore(adapt_root(cfg, kind, model) / "versions", head_checkpoint(cfg, kind, model))


def model_buffer(cfg: StudyConfig, kind: str, model: str) -> TrafficBuffer:
    a = cfg.serve.adapt
    return TrafficBuffer(adapt_root(cfg, kind, model) / "buffer", a.buffer_tokens, a.max_age_s)


@dataclass
class RoundResult:
    served: int  # the version scored against
    candidate_acc: float
    served_acc: float
    published: int | None  # the new version, or None: the candidate did not beat the served one
    train_sequences: int
    heldout_sequences: int
    seconds: float


class OnlineTrainer:
    def __init__(self, cfg: StudyConfig, model: str, kind: str | None = None) -> None:
        self.cfg, self.model = cfg, model
        self.kind = kind or cfg.serve.head_kind
        self.adapt = cfg.serve.adapt
        self.store, self.buffer = model_store(cfg, self.kind, model), model_buffer(cfg, self.kind, model)
        target = load_training_target(cfg.target)  # the embeddings and LM head only, as offline training
        vocab = draft_vocabulary(cfg, target.tokenizer, target.stop_token_ids)
        self.frozen = FrozenTarget.from_model(target.model, torch.float32, vocab)
        self.full_lm_head = target.model.get_output_embeddings().weight.detach().float()
        train = cfg.train.model_copy(update={"precision": self.adapt.precision or cfg.train.precision})
        self.settings = LossSettings.for_kind(self.kind, train, cfg.tree.depth)
        self.passes = max(1, cfg.train.hca_passes)
        self.rng = random.Random(cfg.train.seed)
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.seen: set[str] = set()  # shards some round has read
        self._start_from(self.store.current().number)

    def _start_from(self, number: int) -> None:
        """The candidate restarts from the served version `number`, with a fresh optimizer."""
        self.base = number
        self.head = DraftHead.load(self.store.version(number).path, torch.float32)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.adapt.lr, betas=(0.9, 0.95),
                                           weight_decay=self.cfg.train.weight_decay)

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
        examples = [self._with_topk(e) for e in self.buffer.read(shards) if int(e.loss_mask.sum()) > 0]
        if len(examples) < 2:
            return None
        held_n = max(1, math.ceil(len(examples) * self.adapt.heldout_fraction))
        train, held = examples[:-held_n], examples[-held_n:]
        self._train(train)
        served_head = DraftHead.load(served.path, torch.float32)
        served_acc, candidate_acc = self.agreement(served_head, held), self.agreement(self.head, held)
        published = None
        if candidate_acc > served_acc + self.adapt.min_gain:
            metrics = {"heldout_acc": candidate_acc, "served_acc": served_acc, "heldout_sequences": len(held)}
            version = self.store.publish(self.head, metrics, over=served.number)
            if version is None:  # rolled back while this round trained: start again from what serves now
                self._start_from(self.store.current().number)
            else:
                published = self.base = version.number
        return RoundResult(served.number, candidate_acc, served_acc, published, len(train), len(held),
                           time.perf_counter() - start)

    def agreement(self, head: DraftHead, examples: list[Example]) -> float:
        """Top-1 agreement with the target (the trainer's held-out metric) over `examples`."""
        return evaluate(head, self._batches(examples), self.frozen, self.settings, passes=self.passes)["acc"]

    def _train(self, examples: list[Example]) -> None:
        self.head.train()
        size = self.adapt.batch_size
        for _ in range(self.adapt.steps_per_round):
            batch = collate(self.rng.sample(examples, min(size, len(examples))))
            self.optimizer.zero_grad(set_to_none=True)
            run_passes(self.head, batch, self.frozen, self.settings, backward=True, generator=self.generator)
            torch.nn.utils.clip_grad_value_(self.head.parameters(), self.cfg.train.grad_clip_value)
            self.optimizer.step()
        self.head.eval()

    def _batches(self, examples: list[Example]) -> list[Batch]:
        ordered = sorted(examples, key=len)
        size = self.cfg.train.eval_batch_size
        return [collate(ordered[i: i + size]) for i in range(0, len(ordered), size)]

    @torch.no_grad()
    def _with_topk(self, example: Example) -> Example:
        """The target's top-K next-token probabilities from its LM head over the recorded features (what feature
        extraction stores; HASS's top-K term reads them): the replica records features only."""
        probs = torch.softmax(example.hidden.float() @ self.full_lm_head.T, dim=-1)
        top = probs.topk(self.cfg.features.top_k, dim=-1)
        return Example(example.id, example.input_ids, example.loss_mask, example.hidden,
                       top.values.to(PROBS_DTYPE), top.indices, example.aux)


class OnlineTrainerActor:
    """The Ray actor (`start_trainer`): rounds in a loop on its own CPUs, beside the replicas."""

    def __init__(self, config: dict[str, Any], model: str, kind: str | None = None) -> None:
        cfg = parse_config(config, "<online trainer>")
        torch.set_num_threads(max(1, math.ceil(cfg.serve.adapt.trainer_num_cpus)))
        self.trainer = OnlineTrainer(cfg, model, kind)
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
            result = self._round(force=False) if self._running.is_set() else None
            if result is None:
                self._stop.wait(idle_s)
        return len(self.history)

    def train_for(self, seconds: float) -> int:
        """Rounds back to back for `seconds`, new traffic or not; returns how many ran."""
        end, rounds = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            rounds += self._round(force=True) is not None
        return rounds

    def _round(self, force: bool) -> RoundResult | None:
        with self._training:
            started = time.time()
            result = self.trainer.round(force)
        if result is not None:
            self.history.append({**asdict(result), "started": started, "ended": time.time()})
        return result

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
