"""The proposer contract: every way of drafting looks the same to the decoding loop and to replay.

A proposer is stateless; what it remembers about one sequence (its heads' stable caches, a routing choice) lives
in an explicit state object that the loop passes in and gets back. That keeps two heads from sharing a cache and
lets a Ray actor hold the states of many sequences.

A new proposer subclasses `Proposer`, implements `init_state` and `propose`, and overrides only the capabilities
it has: each has a default that is right for a proposer without it, so the loop and replay call them all without
probing (`drafts`: whether it ever drafts beyond the root; `propose_batch`: batched drafting; `feature_layers`:
EAGLE-3's fused target layers; `times_itself`: the cost model's own judgement; `head_of`: a router's choice;
`observe`: what verification accepted, for proposers that learn online; `map_heads` and `replay_refusal`: how replay
swaps in precomputed trees, and online adaptation a new version of one head; `with_part`: a head added to a router).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from taps_ray.drafting.tree import DraftTree

NOT_DRAFTED = -2  # StepRecord.head of a step that verified only the root (drafting paused by `draft_below`)


@dataclass(frozen=True)
class Feedback:
    """What verification did with one sequence's drafted tree, handed back to its proposer (`Proposer.observe`)."""

    tree: DraftTree  # the tree that was verified
    nodes: list[int]  # accepted node indices, root first
    tokens: list[int]  # what the step committed: the accepted drafted tokens, then the target's bonus token

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the root is the previous step's, not a draft)."""
        return len(self.nodes) - 1


Pending = Sequence[tuple[torch.Tensor, torch.Tensor]]  # committed (features, next tokens) a proposer has yet to read


def join_pending(pending: Pending) -> tuple[torch.Tensor, torch.Tensor]:
    """The pending pieces as one (features, next tokens) pair, for one `propose` call (no copy for a single piece)."""
    if len(pending) == 1:
        return pending[0]
    return torch.cat([f for f, _ in pending]), torch.cat([t for _, t in pending])


def shared_feature_layers(proposers: Iterable[Proposer], what: str) -> tuple[int, ...]:
    """The target layers every feature-reading proposer of `proposers` drafts from (token-only ones, plain and
    n-gram, fit any): they read the same committed features, so they must agree; `what` names them in the error."""
    layers = {p.feature_layers for p in proposers if p.reads_features}
    if len(layers) > 1:
        raise ValueError(f"{what} draft from different target layers: {sorted(layers)}")
    return layers.pop() if layers else ()


class Proposer(ABC):
    """Drafts a token tree per sequence from the target's committed features and tokens."""

    name: str
    head_names: list[str]  # the heads a `StepRecord.head` index refers to (empty: no head)
    feature_layers: tuple[int, ...] = ()  # target layers to fuse for `propose` (EAGLE-3); (): the post-norm last
    replay_refusal: ClassVar[str | None] = None  # why replay cannot stand in for live decoding, if it cannot
    drafts: ClassVar[bool] = True  # False: only root-only trees (plain decoding), so a loop's DraftGate ignores it
    reads_features: ClassVar[bool] = True  # False: drafts from tokens alone (plain, n-gram): any feature_layers fit
    times_itself: ClassVar[bool] = False  # True: drafts only where its own step timings say it pays (the cost model)

    @abstractmethod
    def init_state(self) -> Any:
        """A new sequence's state."""

    @abstractmethod
    def propose(self, state: Any, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, Any]:
        """Extend the proposer's context with committed (feature, next token) pairs and draft a tree.

        `features` [m, d]: target features of the positions committed since the last call (the prompt on
        the first call; [m, k*d] the fused layers of `feature_layers` for EAGLE-3 proposers); `next_tokens`
        [m]: the token after each of them; the last one is the tree's root.
        """

    def propose_batch(
        self, states: list[Any], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> tuple[list[DraftTree], list[Any]]:
        """`propose` for several sequences at once (the loop's one call per step); by default one by one, a
        proposer that drafts a batch in one pass overrides it."""
        out = [self.propose(state, f, t) for state, f, t in zip(states, features, next_tokens, strict=True)]
        return [tree for tree, _ in out], [state for _, state in out]

    def head_of(self, state: Any) -> int:
        """Which of `head_names` drafted the tree the last `propose` returned with `state` (-1: a merged tree,
        NOT_DRAFTED: none); a proposer with one head always drafts with head 0."""
        return 0

    def observe(self, states: list[Any], feedback: list[Feedback]) -> list[Any]:
        """After verification: the states of the sequences this proposer drafted for, and what was accepted of
        each one's tree; returns their new states. No-op by default; a router that learns from acceptance or
        a head that adapts online overrides it."""
        return states

    def map_heads(self, swap: Callable[[Proposer], Proposer]) -> Proposer:
        """This proposer with every EAGLE head drafter inside it (`SingleHead`, alone or as a part) replaced by
        `swap(head)`: replay swaps in heads that answer from precomputed trees. A proposer without heads is
        returned as it is."""
        return self

    def with_part(self, part: Proposer) -> Proposer:
        """This proposer with `part` (a head drafter) drafting beside its own parts: online adaptation adds a spawned
        head to a router (docs/serve.md#spawning-heads). Only a proposer that combines parts can."""
        raise ValueError(f"proposer {self.name!r} does not combine heads, so no head can be added to it")
