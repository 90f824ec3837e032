"""`learned-routed` (ours, beyond TAPS): a per-sequence router that learns from verification which head to draft with
(docs/algorithms.md#learned-routing).

A merged step (both heads' trees under one root, as `merged`) costs one target call and tells, for every head, how
many tokens of what the target committed its own tree held: full information, at no extra target call. The router
keeps Hedge's exponential weights over the heads, p_h ∝ exp(η·S_h), where S_h is the discounted sum of those
counts over the sequence's merged steps (discount γ per merged step, so a sequence whose topic moves, such as a
second MT-Bench turn, moves its router too). It verifies merged trees while it is unsure (the leader's weight
below `sure`, or fewer than `warmup` merged steps so far) and every `period` steps after; in between only the
leader drafts, and the tree verified is the leader's alone: one head's drafting and a single tree's verification
per step, against confidence routing's two heads drafting every step and merged trees' two heads plus a double-
width verification every step (anchors: HedgeSpec, arXiv 2510.20064; MetaSD, arXiv 2604.05417).

A head that sits a step out keeps the committed positions it missed (`backlog`) and reads them all the next time
it drafts, as the loop does for a paused proposer, so its context stays whole. The rule is deterministic (no
draw), so replay reproduces the live decode exactly at T = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from taps_ray.config import TreeConfig
from taps_ray.drafting.combine import OverParts, first_two, single_heads
from taps_ray.drafting.eagle2 import DraftContext
from taps_ray.drafting.proposer import Feedback, join_pending
from taps_ray.drafting.tree import DraftTree
from taps_ray.drafting.tree_merge import merge_stack
from taps_ray.drafting.tree_stack import stack_trees
from taps_ray.models.draft_head import DraftHead

MERGED = -1  # `last_head` of a merged step


@dataclass(frozen=True)
class LearnedState:
    """One sequence's router: every head's own state and the committed positions it has yet to read, the
    discounted acceptance each head would have had on merged steps (`scores`), and what drafted last."""

    parts: tuple[Any, ...]
    backlog: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...]  # per head: (features, next tokens) missed
    scores: tuple[float, ...]
    merged_steps: int = 0
    since_merged: int = 0
    last_head: int = MERGED


@dataclass
class LearnedRouted(OverParts):
    """Hedge over the heads, fed by merged steps' full-information acceptance; the leader drafts alone once sure."""

    name: str = "learned-routed"
    eta: float = 1.0  # Hedge's learning rate, per accepted token
    discount: float = 0.7  # γ: weight of older merged steps' acceptance at each new merged step
    sure: float = 0.9  # the leader drafts alone once its Hedge weight reaches this
    warmup: int = 2  # merged steps every sequence starts with
    period: int = 16  # a merged step at least this often, so a leader that stops fitting is noticed

    initial_head: ClassVar[int] = MERGED

    def init_state(self) -> LearnedState:
        return LearnedState(parts=tuple(p.init_state() for p in self.parts),
                            backlog=tuple(() for _ in self.parts), scores=tuple(0.0 for _ in self.parts))

    def weights(self, state: LearnedState) -> list[float]:
        """Hedge's weights over the heads: a softmax of η times the discounted scores."""
        top = max(state.scores)
        raw = [math.exp(self.eta * (s - top)) for s in state.scores]
        return [r / sum(raw) for r in raw]

    def choice(self, state: LearnedState) -> int:
        """The head that drafts this step alone, or MERGED for a merged step (ties to the earlier head)."""
        if state.merged_steps < self.warmup or state.since_merged + 1 >= self.period:
            return MERGED
        weights = self.weights(state)
        leader = max(range(len(weights)), key=lambda h: (weights[h], -h))
        return leader if weights[leader] >= self.sure else MERGED

    def propose_batch(
        self, states: list[LearnedState], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> tuple[list[DraftTree], list[LearnedState]]:
        """Every sequence's tree: the sequences of a merged step draft with every head, the others with their
        leader; each head drafts all of its sequences in one `propose_batch`."""
        choices = [self.choice(state) for state in states]
        drafted: list[dict[int, DraftTree]] = [{} for _ in states]
        new_parts = [list(state.parts) for state in states]
        backlog = [[list(b) for b in state.backlog] for state in states]
        for s in range(len(states)):
            for h in range(len(self.parts)):
                backlog[s][h].append((features[s], next_tokens[s]))
        for h, part in enumerate(self.parts):
            group = [s for s, c in enumerate(choices) if c in (MERGED, h)]
            if not group:
                continue
            features_h, tokens_h = zip(*(join_pending(backlog[s][h]) for s in group))
            trees, part_states = part.propose_batch([new_parts[s][h] for s in group], list(features_h),
                                                    list(tokens_h))
            for s, tree, part_state in zip(group, trees, part_states, strict=True):
                drafted[s][h], new_parts[s][h], backlog[s][h] = tree, part_state, []
        out_trees = [d.get(c) for d, c in zip(drafted, choices, strict=True)]
        merging = [s for s, c in enumerate(choices) if c == MERGED]
        if merging:  # every merged step's tree in one batched merge on the device
            merged, _ = merge_stack(stack_trees([[drafted[s][h] for h in sorted(drafted[s])] for s in merging]),
                                    "concat")
            for s, tree in zip(merging, merged, strict=True):
                out_trees[s] = tree
        out_states = [
            replace(state, parts=tuple(parts), backlog=tuple(map(tuple, pending)), last_head=c,
                    since_merged=0 if c == MERGED else state.since_merged + 1)
            for state, parts, pending, c in zip(states, new_parts, backlog, choices, strict=True)
        ]
        return out_trees, out_states

    def observe(self, states: list[LearnedState], feedback: list[Feedback]) -> list[LearnedState]:
        """A merged step's acceptance per head (how much of what the target committed each head's subtree held)
        updates the scores; a single head's step teaches nothing about the other, so it leaves them as they are."""
        merged = [b for b, state in enumerate(states) if state.last_head == MERGED]
        held = iter(held_per_sources([feedback[b].tree for b in merged], [feedback[b].tokens for b in merged],
                                     len(self.parts)) if merged else [])
        out = []
        for state in states:
            if state.last_head != MERGED:
                out.append(state)
                continue
            scores = tuple(self.discount * s + a for s, a in zip(state.scores, next(held), strict=True))
            out.append(replace(state, scores=scores, merged_steps=state.merged_steps + 1))
        return out


def held_per_source(tree: DraftTree, committed: list[int], sources: int) -> list[int]:
    """Per source of a merged tree: the length of the longest path from the root, through that source's nodes
    only, that spells a prefix of `committed` (the tokens verification kept). At T = 0 it is exactly what that
    head alone would have had accepted: a longer match would have been accepted in the merged tree too."""
    return held_per_sources([tree], [committed], sources)[0]


def held_per_sources(trees: list[DraftTree], committed: list[list[int]], sources: int) -> list[list[int]]:
    """`held_per_source` of every tree, their nodes read from the device in one read for the batch."""
    device = trees[0].tokens.device
    flat = torch.cat([*(t.tokens for t in trees), *(t.parents for t in trees),
                      *(t.source.to(device) for t in trees)]).tolist()
    sizes = [t.size for t in trees]
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    total, drafted = ends[-1], [n - 1 for n in sizes]
    source_starts = [2 * total + sum(drafted[:i]) for i in range(len(trees))]
    return [_held(flat[end - n : end], flat[total + end - n : total + end], [-1, *flat[start : start + n - 1]],
                  tokens, sources)
            for end, n, start, tokens in zip(ends, sizes, source_starts, committed, strict=True)]


def _held(tokens: list[int], parents: list[int], source: list[int], committed: list[int], sources: int
          ) -> list[int]:
    """`held_per_source` on the host, from one tree's tokens, parents and per-node source (-1 at the root)."""
    children: dict[tuple[int, int, int], int] = {}  # (parent, source, token) -> node
    for node in range(1, len(tokens)):
        children.setdefault((parents[node], source[node], tokens[node]), node)
    held = []
    for head in range(sources):
        node, length = 0, 0
        for token in committed:
            node = children.get((node, head, token), -1)
            if node < 0:
                break
            length += 1
        held.append(length)
    return held


def build_learned_routed(heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig) -> LearnedRouted:
    """Over the first two heads in config order (A, B), as the other combinations."""
    return LearnedRouted(single_heads(first_two(heads, "learned-routed"), context, tree))
