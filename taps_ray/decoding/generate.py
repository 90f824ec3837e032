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
from taps_ray.decoding.draft_step import Drafting, draft
from taps_ray.drafting.proposers import Proposer, feature_layers
from taps_ray.drafting.tree import DraftTree

if TYPE_CHECKING:  # an annotation only: importing the class loads transformers' model code (a drafter imports this)
    from transformers import PreTrainedModel



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


def record_step(tree: DraftTree, verdict: Verdict, new_tokens: int, draft_s: float, verify_s: float, head: int,
                nodes: tuple[list[float], list[float], list[int]] | None = None) -> StepRecord:
    """One step's record; `nodes`: the tree's per-node (confidence, entropy, source) already read to the host
    (`node_values`, one read for a batch), else read here."""
    accepted = [False] * tree.size
    for node in verdict.nodes:
        accepted[node] = True
    confidence, entropy, source = nodes if nodes is not None else node_values([tree])[0]
    return StepRecord(
        accepted=verdict.accepted,
        new_tokens=new_tokens,
        tree_size=tree.size,
        draft_s=draft_s,
        verify_s=verify_s,
        head=head,
        node_confidence=confidence,
        node_entropy=entropy,
        node_accepted=accepted[1:],
        node_source=source,
    )


def node_values(trees: list[DraftTree]) -> list[tuple[list[float], list[float], list[int]]]:
    """Each tree's per-node confidences, entropies and sources on the host, in one device-to-host read."""
    if not trees:
        return []
    device = trees[0].tokens.device
    flat = torch.stack([torch.cat([getattr(t, name).to(device) for t in trees]).double()
                        for name in ("confidence", "entropy", "source")]).tolist()
    out, at = [], 0
    for tree in trees:
        n = tree.size - 1
        conf, ent, src = (row[at : at + n] for row in flat)
        out.append((conf, ent, [int(s) for s in src]))
        at += n
    return out


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
    sequences = [Drafting(proposer, proposer.init_state()) for _ in prompts]

    def draft_unfinished(committed: dict[int, Committed]) -> None:
        """Hand each unfinished sequence what it committed and draft all of their next trees at once."""
        live = [b for b in committed if not generations[b].finished_by]
        for b in live:
            sequences[b].pending.append((committed[b].features, committed[b].next_tokens))
        unfinished = sum(not g.finished_by for g in generations)
        draft([sequences[b] for b in live], draft_below is None or unfinished < draft_below)

    for b, committed in enumerate(started):
        extend_tokens(generations[b], committed.tokens, stops, budgets[b])
    draft_unfinished(dict(enumerate(started)))  # after every sequence is extended, so the finished are counted

    while any(seq.tree is not None for seq in sequences):
        trees = [seq.tree for seq in sequences]
        t0 = time.perf_counter()
        results = verifier.step(trees)
        verify_s = time.perf_counter() - t0
        done = {b: committed for b, committed in enumerate(results) if committed is not None}
        values = node_values([trees[b] for b in done])
        for (b, committed), nodes in zip(done.items(), values):
            generation, seq = generations[b], sequences[b]
            extend_tokens(generation, committed.tokens, stops, budgets[b])
            generation.steps.append(record_step(seq.tree, committed.verdict, step_tokens(committed.tokens, stops),
                                                seq.draft_s, verify_s, seq.head, nodes))
            seq.tree = None
        draft_unfinished(done)
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
