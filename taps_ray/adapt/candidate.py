"""What every online training round needs, shared by the trainers of one actor: the target side (its frozen
embeddings and LM head, the project's loss settings, the held-out score) and a candidate head in training.

A routed model's trainer trains one candidate per head and, when asked, one spawned head; they all read the same
target, loaded once (`TargetSide`).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from taps_ray.adapt.duty import DutyCycle
from taps_ray.config import StudyConfig
from taps_ray.data.draft_vocab import draft_vocabulary
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.draft_parts import load_training_target
from taps_ray.training.features import PROBS_DTYPE, Example
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes
from taps_ray.training.trainer import collate, evaluate


class Candidate:
    """A head in training: its weights and its optimizer, kept across rounds (training continues)."""

    def __init__(self, cfg: StudyConfig, path: str | Path) -> None:
        self.head = DraftHead.load(path, torch.float32)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.serve.adapt.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.train.weight_decay)


class TargetSide:
    def __init__(self, cfg: StudyConfig, kind: str) -> None:
        self.cfg, self.adapt = cfg, cfg.serve.adapt
        target = load_training_target(cfg.target)  # the embeddings and LM head only, as offline training
        vocab = draft_vocabulary(cfg, target.tokenizer, target.stop_token_ids)
        self.frozen = FrozenTarget.from_model(target.model, torch.float32, vocab)
        self.full_lm_head = target.model.get_output_embeddings().weight.detach().float()
        train = cfg.train.model_copy(update={"precision": self.adapt.precision or cfg.train.precision})
        self.settings = LossSettings.for_kind(kind, train, cfg.tree.depth)
        self.passes = max(1, cfg.train.hca_passes)
        self.rng = random.Random(cfg.train.seed)
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.pace = DutyCycle(self.adapt.trainer_duty)  # rests after each optimizer step below a duty of 1

    def split(self, examples: list[Example]) -> tuple[list[Example], list[Example]]:
        """Training and held-out sequences: the newest `heldout_fraction` is held out (the traffic to come)."""
        held_n = max(1, math.ceil(len(examples) * self.adapt.heldout_fraction))
        return examples[:-held_n], examples[-held_n:]

    def train(self, candidate: Candidate, examples: list[Example]) -> None:
        """`steps_per_round` optimizer steps of the project's loss on batches drawn from `examples`."""
        head, size = candidate.head, self.adapt.batch_size
        head.train()
        for _ in range(self.adapt.steps_per_round):
            with self.pace:
                batch = collate(self.rng.sample(examples, min(size, len(examples))))
                candidate.optimizer.zero_grad(set_to_none=True)
                run_passes(head, batch, self.frozen, self.settings, backward=True, generator=self.generator)
                torch.nn.utils.clip_grad_value_(head.parameters(), self.cfg.train.grad_clip_value)
                candidate.optimizer.step()
        head.eval()

    def agreement(self, head: DraftHead, examples: list[Example]) -> float:
        """Top-1 agreement with the target (the trainer's held-out metric) over `examples`."""
        return evaluate(head, self._batches(examples), self.frozen, self.settings, passes=self.passes)["acc"]

    def _batches(self, examples: list[Example]) -> list[Batch]:
        ordered = sorted(examples, key=len)
        size = self.cfg.train.eval_batch_size
        return [collate(ordered[i: i + size]) for i in range(0, len(ordered), size)]

    @torch.no_grad()
    def with_topk(self, example: Example) -> Example:
        """The target's top-K next-token probabilities from its LM head over the recorded features (what feature
        extraction stores; HASS's top-K term reads them): the replica records features only."""
        probs = torch.softmax(example.hidden.float() @ self.full_lm_head.T, dim=-1)
        top = probs.topk(self.cfg.features.top_k, dim=-1)
        return Example(example.id, example.input_ids, example.loss_mask, example.hidden,
                       top.values.to(PROBS_DTYPE), top.indices, example.aux)
