"""The basic proposers (no drafting, one EAGLE head) and a recording wrapper; the contract they follow is
`drafting/proposer.py`'s `Proposer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.stacked_head import stack_mismatch
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, draft_eagle2, head_context
from taps_ray.drafting.tree import DraftTree, root_only


class Recording(Proposer):
    """Any proposer, recording each call's (features, next_tokens, tree, state): a benchmark or test can then
    replay the same draft calls through other drafting code and compare."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.name, self.head_names = inner, inner.name, inner.head_names
        self.feature_layers = inner.feature_layers
        self.calls: list[tuple[torch.Tensor, torch.Tensor, DraftTree, Any]] = []

    def init_state(self) -> Any:
        return self.inner.init_state()

    def propose(self, state: Any, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, Any]:
        tree, new_state = self.inner.propose(state, features, next_tokens)
        self.calls.append((features.clone(), next_tokens.clone(), tree, new_state))
        return tree, new_state

    def head_of(self, state: Any) -> int:
        return self.inner.head_of(state)


class PlainDecoding(Proposer):
    """No drafting: a root-only tree, so the loop degenerates into ordinary autoregressive decoding."""

    name = "plain"
    head_names: list[str] = []
    drafts = False
    reads_features = False

    def init_state(self) -> None:
        return None

    def propose(self, state: None, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, None]:
        return root_only(next_tokens[-1:], next_tokens.device), None


@dataclass
class SingleHead(Proposer):
    """One EAGLE head drafting EAGLE-2 dynamic trees."""

    name: str
    head: DraftHead
    context: DraftContext
    tree: TreeConfig

    def __post_init__(self) -> None:
        self.context = head_context(self.head, self.context)

    @property
    def head_names(self) -> list[str]:
        return [self.name]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.head.config.feature_layers)

    def init_state(self) -> HeadCache:
        return HeadCache()

    def propose(self, state: HeadCache, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, HeadCache]:
        ((tree,),), (cache,) = draft_eagle2(self.head, self.context, [state], [features], [next_tokens], self.tree)
        return tree, cache

    def propose_batch(
        self, states: list[HeadCache], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> tuple[list[DraftTree], list[HeadCache]]:
        """Every sequence's tree in one forward per tree level (`draft_eagle2`)."""
        trees, caches = draft_eagle2(self.head, self.context, states, features, next_tokens, self.tree)
        return [t for (t,) in trees], caches

    def map_heads(self, swap: Callable[[Proposer], Proposer]) -> Proposer:
        return swap(self)


def stackable(parts: Sequence[Proposer]) -> bool:
    """Whether `parts` can draft side by side as one `StackedHead` (models/stacked_head.py): `SingleHead`s with
    one context and one tree setting whose heads stack (`stack_mismatch`)."""
    if not parts or not all(isinstance(p, SingleHead) for p in parts):
        return False
    first = parts[0]
    same_drafting = all(p.context is first.context and p.tree == first.tree for p in parts)
    return same_drafting and stack_mismatch([p.head for p in parts]) is None

