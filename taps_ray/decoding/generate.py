"""The speculative decoding loop over a batch of sequences, with per-step records.

draft (proposer, per sequence) -> verify (target, one batched forward) -> accept (per sequence) -> commit.
Plain decoding is the same loop with `PlainDecoding`, so every speedup compares like with like.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from taps_ray.decoding.target_batch import Committed, TargetBatch
from taps_ray.decoding.verify import SamplingParams, Verdict
from taps_ray.drafting.proposers import Proposer, feature_layers
from taps_ray.drafting.tree import DraftTree, root_only

if TYPE_CHECKING:  # an annotation only: importing the class loads transformers' model code (a drafter imports this)
    from transformers import PreTrainedModel

NOT_DRAFTED = -2  # StepRecord.head of a step that verified only the root (drafting paused by `draft_below`)


@dataclass
class StepRecord:
    accepted: int  # drafted tokens accepted (a_k); the step commits a_k + 1 tokens
    new_tokens: int  # tokens this step committed, trimmed after a stop token only (`step_tokens`)
    tree_size: int  # nodes verified, root included
    draft_s: float
    verify_s: float
    head: int  # which head's tree was verified (routers), -1 for a merged tree, NOT_DRAFTED (-2) for none
    node_confidence: list[float]
    node_entropy: list[float]
    node_accepted: list[bool]
    node_source: list[int]


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated tokens, cut after the first stop token
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0
    finished_by: str = ""

    @property
    def tau(self) -> float:
        """Spec-Bench #MAT: tokens per target verification step (the prefill's first token excluded)."""
        return sum(s.new_tokens for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def tau_taps(self) -> float:
        """The TAPS/EAGLE reference definition: untrimmed committed tokens over (steps - 1); nan for a one-step
        turn, which adds its tokens but no step to a cell's pooled τ_TAPS (docs/algorithms.md#acceptance-length)."""
        committed = sum(s.accepted + 1 for s in self.steps)
        return committed / (len(self.steps) - 1) if len(self.steps) > 1 else math.nan


def record_step(tree: DraftTree, verdict: Verdict, new_tokens: int, draft_s: float, verify_s: float, head: int) -> StepRecord:
    accepted = [False] * tree.size
    for node in verdict.nodes:
        accepted[node] = True
    return StepRecord(
        accepted=verdict.accepted,
        new_tokens=new_tokens,
        tree_size=tree.size,
        draft_s=draft_s,
        verify_s=verify_s,
        head=head,
        node_confidence=tree.confidence.tolist(),
        node_entropy=tree.entropy.tolist(),
        node_accepted=accepted[1:],
        node_source=tree.source.tolist(),
    )


def extend_tokens(generation: Generation, new: list[int], stop_ids: set[int], max_new_tokens: int) -> int:
    """Append new tokens, cut at the first stop token or at max_new_tokens; returns how many were kept."""
    kept = 0
    for token in new:
        if generation.finished_by:
            break
        generation.tokens.append(token)
        kept += 1
        if token in stop_ids:
            generation.finished_by = "stop"
        elif len(generation.tokens) >= max_new_tokens:
            generation.finished_by = "length"
    return kept


def step_tokens(new: list[int], stop_ids: set[int]) -> int:
    """A step's Spec-Bench new tokens: all it committed, cut just after the first stop token. The token budget does
    not trim it, so the step that crosses `max_new_tokens` keeps its full accepted length
    (docs/algorithms.md#acceptance-length)."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return i + 1
    return len(new)


def chosen_head(state: object) -> int:
    """Routers expose the head they used last as `state.last_head`; single heads are head 0."""
    return getattr(state, "last_head", 0)


class Verifier(Protocol):
    """The target side of the loop: in-process `TargetBatch`, or a proxy to a Ray target worker."""

    def start(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Committed]: ...

    def step(self, trees: list[DraftTree | None]) -> list[Committed | None]: ...


@torch.no_grad()
def run_loop(
    verifier: Verifier,
    proposer: Proposer,
    prompts: list[list[int]],
    params: SamplingParams,
    max_new_tokens: int | list[int],
    stop_ids: list[int],
    seeds: list[int] | None = None,
    draft_below: int | None = None,
) -> list[Generation]:
    """Decode every prompt to a stop token or `max_new_tokens` (one for all, or one per prompt); sequence b
    samples with its own seed. A sequence leaves the batched forward as soon as it is finished.

    `draft_below`: draft only while fewer sequences than this are unfinished; otherwise a step verifies just the
    root (plain decoding, still lossless). A batched target forward over many tree tokens is compute-bound on a
    CPU (and on a GPU at large batches), where speculation costs more than it saves. The committed positions a
    paused proposer missed are handed to it when drafting resumes, so its context stays whole.
    """
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or min(budgets, default=1) < 1:
        raise ValueError(f"max_new_tokens must be at least 1, one for all prompts or one per prompt: {max_new_tokens}")
    if draft_below is not None and draft_below < 1:
        raise ValueError(f"draft_below must be at least 1 (or None to always draft), got {draft_below}")
    seeds = seeds if seeds is not None else list(range(len(prompts)))
    stops = set(stop_ids)
    start = time.perf_counter()
    started = verifier.start(prompts, params, seeds)
    prefill_s = time.perf_counter() - start

    generations = [Generation(prompt=list(p), prefill_s=prefill_s) for p in prompts]
    states = [proposer.init_state() for _ in prompts]
    trees: list[DraftTree | None] = [None] * len(prompts)
    draft_times = [0.0] * len(prompts)
    heads = [NOT_DRAFTED] * len(prompts)
    missed: list[list[Committed]] = [[] for _ in prompts]  # committed while drafting was paused

    def draft(b: int, committed: Committed) -> None:
        unfinished = sum(not g.finished_by for g in generations)
        if draft_below is not None and unfinished >= draft_below:
            missed[b].append(committed)
            root = committed.next_tokens[-1]
            trees[b], draft_times[b], heads[b] = root_only(int(root), root.device), 0.0, NOT_DRAFTED
            return
        parts, missed[b] = [*missed[b], committed], []
        features, next_tokens = torch.cat([c.features for c in parts]), torch.cat([c.next_tokens for c in parts])
        t0 = time.perf_counter()
        trees[b], states[b] = proposer.propose(states[b], features, next_tokens)
        draft_times[b] = time.perf_counter() - t0
        heads[b] = chosen_head(states[b])

    for b, committed in enumerate(started):
        extend_tokens(generations[b], committed.tokens, stops, budgets[b])
    for b, committed in enumerate(started):  # after every sequence is extended, so `draft` counts the finished
        if not generations[b].finished_by:
            draft(b, committed)

    while any(t is not None for t in trees):
        t0 = time.perf_counter()
        results = verifier.step(trees)
        verify_s = time.perf_counter() - t0
        for b, committed in enumerate(results):
            if committed is None:
                continue
            generation = generations[b]
            extend_tokens(generation, committed.tokens, stops, budgets[b])
            step = record_step(trees[b], committed.verdict, step_tokens(committed.tokens, stops), draft_times[b],
                               verify_s, heads[b])
            generation.steps.append(step)
            trees[b] = None
        for b, committed in enumerate(results):
            if committed is not None and not generations[b].finished_by:
                draft(b, committed)
    wall = time.perf_counter() - start
    for generation in generations:
        generation.wall_s = wall
    return generations


def generate(
    model: PreTrainedModel,
    proposer: Proposer,
    prompts: list[list[int]],
    params: SamplingParams,
    max_new_tokens: int,
    stop_ids: list[int],
    seeds: list[int] | None = None,
) -> list[Generation]:
    """In-process decoding: one `TargetBatch` verifies every sequence's tree in one forward per step."""
    batch = TargetBatch(model, feature_layers=feature_layers(proposer))
    return run_loop(batch, proposer, prompts, params, max_new_tokens, stop_ids, seeds)
