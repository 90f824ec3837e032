"""TAPS combinations of specialised draft heads (docs/algorithms.md#taps-combinations), registered by name in `COMBINATIONS`.

Head A is the first head of the config (math), head B the second (chat).

* `averaged`, `averaged-w{w}`: one head whose weights are w·A + (1−w)·B (docs/algorithms.md#weight-averaging); `averaged` is w = 0.5.
* `confidence-routed`: both heads draft every step; the tree with the higher mean confidence is verified (docs/algorithms.md#confidence-routing).
* `entropy-routed`: every head, and the averaged head when there are two (TAPS's candidates), drafts once at the
  start of a sequence; the lowest mean entropy one then drafts alone for the rest of it
  (docs/algorithms.md#entropy-routing).
* `merged`: both trees under one shared root, verified together (docs/algorithms.md#merged-tree-verification, the reference method).
* `merged-dedup` (ours, a change to the method): a trie merge; a node that repeats a path already in the tree
  is drafted once, so the same continuations cost fewer verified nodes.
* `<proposer>+ngram` (ours, e.g. `math+ngram`): a heterogeneous merge of any proposer's tree with prompt-lookup
  drafts (drafting/ngram.py): the single-head budget of total_token−1 nodes goes to the most confident nodes of
  either, trie-merged (`rank_merge`), with the n-gram nodes' confidence calibrated per sequence.
* `merged-budget` (ours): one tree of the single-head size (total_token−1 drafted nodes) split between the
  heads in proportion to their mean confidence, each head's share its most confident nodes, trie-merged.

Combinations are built over sub-proposers (one `SingleHead` per head), so each head keeps its own stable
cache in an explicit state and the heads can never clobber each other (docs/algorithms.md#taps-combinations). The routed and merged
proposers accept any `Proposer` parts, which lets tests combine oracle drafters with real heads. When every
part drafts every step (confidence routing, merged trees) and the parts are `SingleHead`s whose heads stack
(same shape, context and tree settings: `stackable`), the heads draft side by side, one batched forward per
tree level in one stacked cache (one `StackedHead` through `draft_eagle2`), giving the trees they would draft one by one; other parts
draft one after the other. Every combination drafts a batch of sequences at once (`propose_batch`): side by side
one forward per tree level for all sequences and heads, else each part over all the sequences, and the trees'
means (what routers choose by) read once for the batch.

A routed state holds `last_head` (the index of the part whose tree was verified; -1 for a merged tree), which
`head_of` reports and the decoding loop copies into `StepRecord.head`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.stacked_head import StackedHead
from taps_ray.drafting.ngram import NgramProposer
from taps_ray.drafting.proposer import Proposer, shared_feature_layers
from taps_ray.drafting.proposers import SingleHead, stackable
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, draft_eagle2
from taps_ray.drafting.tree import DraftTree
from taps_ray.drafting.tree_merge import MODES, budget_merge, merge_stack, merge_trees, rank_merge  # noqa: F401
from taps_ray.drafting.tree_stack import TreeStack, stack_means, stack_trees

# --- checkpoint averaging (docs/algorithms.md#weight-averaging) ---------------------------------------------


def average_heads(a: DraftHead, b: DraftHead, w: float) -> DraftHead:
    """A new head with weights w·A + (1−w)·B, computed in fp32 and cast back to A's dtype.

    Both heads must have identical parameter names and shapes (the same target and the same `fc` bias).
    """
    if not (0.0 <= w <= 1.0) or math.isnan(w):
        raise ValueError(f"averaging weight w={w} must lie in [0, 1] (w is the weight of head A)")
    state_a, state_b = a.trainable_state(), b.trainable_state()
    only_a, only_b = sorted(set(state_a) - set(state_b)), sorted(set(state_b) - set(state_a))
    if only_a or only_b:
        raise ValueError(
            "cannot average draft heads with different parameters: "
            f"only in head A {only_a}, only in head B {only_b} (heads must share the target and the fc bias setting)"
        )
    shapes = {k: (tuple(v.shape), tuple(state_b[k].shape)) for k, v in state_a.items() if v.shape != state_b[k].shape}
    if shapes:
        raise ValueError(f"cannot average draft heads with different shapes (A, B): {shapes}")
    maps = [k for k, v in state_a.items() if not v.is_floating_point() and not torch.equal(v, state_b[k].to(v.device))]
    if maps:
        raise ValueError(f"cannot average draft heads with different draft vocabularies: {maps} differ")
    dtype = next(a.parameters()).dtype
    device = next(a.parameters()).device
    averaged = {k: (w * v.float() + (1.0 - w) * state_b[k].float().to(v.device)).to(v.dtype)
                if v.is_floating_point() else v for k, v in state_a.items()}
    trained_on = f"{w:g}*[{a.config.trained_on or 'A'}]+{1 - w:g}*[{b.config.trained_on or 'B'}]"
    head = DraftHead(a.config.model_copy(update={"trained_on": trained_on}))
    head.load_trainable(averaged)
    return head.to(device=device, dtype=dtype).eval()


# --- per-step and per-sequence routing (docs/algorithms.md#taps-combinations) -------------------------------


@dataclass(frozen=True)
class RouterState:
    """Per-sequence state of a router or merger: every part's own state plus what was chosen last."""

    parts: tuple[Any, ...]  # each part's state; None for a part that no longer drafts (entropy routing)
    stacked: HeadCache | None = None  # instead of `parts`: the heads' one cache when they draft side by side
    last_head: int = 0  # part whose tree was verified last; -1 for a merged tree
    chosen: int | None = None  # entropy routing: the head picked for this sequence
    confidences: tuple[float, ...] = ()  # mean node confidence of each part's last tree (nan if it did not draft)
    entropies: tuple[float, ...] = ()  # mean node entropy of each part's last tree (nan if it did not draft)
    shares: tuple[int, ...] = ()  # merged-budget: nodes allotted to each part; rank merge: nodes each part added


def _draft_parts(
    parts: Sequence[Proposer], states: Sequence[tuple[Any, ...]], features: list[torch.Tensor],
    next_tokens: list[torch.Tensor],
) -> tuple[list[list[DraftTree]], list[tuple[Any, ...]]]:
    """Every part's tree for every sequence, each part drafting all the sequences in one call (`propose_batch`);
    `states[s]` holds sequence s's part states. Returns per sequence the parts' trees and new states."""
    drafted = [part.propose_batch([state[i] for state in states], features, next_tokens)
               for i, part in enumerate(parts)]
    trees = [[drafted[i][0][s] for i in range(len(parts))] for s in range(len(states))]
    new_states = [tuple(drafted[i][1][s] for i in range(len(parts))) for s in range(len(states))]
    return trees, new_states


@dataclass
class OverParts(Proposer):
    """A proposer built from other proposers (its parts): every part keeps its own state in a RouterState
    (or, drafting side by side, one stacked cache: `AllPartsDrafting`)."""

    parts: list[Proposer]
    initial_head: ClassVar[int] = 0  # what `last_head` says before the first verification (-1: merged trees)

    @property
    def head_names(self) -> list[str]:
        return [n for p in self.parts for n in p.head_names]

    @property
    def reads_features(self) -> bool:
        return any(p.reads_features for p in self.parts)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers of the parts that read features (an n-gram part reads tokens only)."""
        return shared_feature_layers(self.parts, "cannot combine heads that")

    def init_state(self) -> RouterState:
        return RouterState(parts=tuple(p.init_state() for p in self.parts), last_head=self.initial_head)

    def head_of(self, state: RouterState) -> int:
        return state.last_head

    def propose(
        self, state: RouterState, features: torch.Tensor, next_tokens: torch.Tensor
    ) -> tuple[DraftTree, RouterState]:
        """One sequence as a batch of one: every combination drafts through its `propose_batch`."""
        (tree,), (new_state,) = self.propose_batch([state], [features], [next_tokens])
        return tree, new_state

    def map_heads(self, swap: Callable[[Proposer], Proposer]) -> Proposer:
        return replace(self, parts=[p.map_heads(swap) for p in self.parts])

    def with_part(self, part: Proposer) -> Proposer:
        return replace(self, parts=[*self.parts, part])


@dataclass
class AllPartsDrafting(OverParts):
    """A proposer whose parts all draft every step, from the same inputs: side by side in one batched forward
    per tree level when they stack (one `StackedHead`), else one after the other."""

    def __post_init__(self) -> None:
        self.side_by_side = StackedHead([p.head for p in self.parts]) if stackable(self.parts) else None

    def init_state(self) -> RouterState:
        if self.side_by_side is None:
            return super().init_state()
        return RouterState(parts=(), stacked=HeadCache(), last_head=self.initial_head)

    def draft_all(
        self, states: list[RouterState], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> tuple[list[list[DraftTree]], list[RouterState]]:
        """Every sequence's parts' trees, and states that hold only the parts' new caches: side by side, one
        forward per tree level for every sequence and head (`draft_eagle2` over the `StackedHead`); else each
        part drafts all the sequences at once."""
        if self.side_by_side is None:
            trees, parts = _draft_parts(self.parts, [s.parts for s in states], features, next_tokens)
            return trees, [RouterState(parts=p) for p in parts]
        first = self.parts[0]  # stackable parts share one context and one tree setting
        trees, caches = draft_eagle2(self.side_by_side, first.context, [s.stacked for s in states], features,
                                     next_tokens, first.tree)
        return [list(t) for t in trees], [RouterState(parts=(), stacked=cache) for cache in caches]

    def propose_batch(
        self, states: list[RouterState], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> tuple[list[DraftTree], list[RouterState]]:
        """Every sequence's tree: its parts' trees drafted for the whole batch, stacked on the device (one
        `TreeStack`), their means read once, then the batch's choice (`combine`)."""
        drafted, caches = self.draft_all(states, features, next_tokens)
        stack = stack_trees(drafted)
        return self.combine(stack, drafted, caches, stack_means(stack))

    def combine(self, stack: TreeStack, drafted: list[list[DraftTree]], caches: list[RouterState],
                means: list[list[tuple[float, float]]]) -> tuple[list[DraftTree], list[RouterState]]:
        """The tree to verify for each sequence from its parts' trees (`drafted`, also stacked: `stack`), and the
        states: `caches` with what was chosen; `means`: the trees' (mean confidence, mean entropy)."""
        raise NotImplementedError


@dataclass
class ConfidenceRouted(AllPartsDrafting):
    """Every part drafts from the same inputs each step; the tree with the highest mean confidence is verified.

    Ties go to the earlier part (head A). Every part's stable cache advances every step, so switching heads
    between steps is free.
    """

    name: str = "confidence-routed"

    def combine(self, stack: TreeStack, drafted: list[list[DraftTree]], caches: list[RouterState],
                means: list[list[tuple[float, float]]]) -> tuple[list[DraftTree], list[RouterState]]:
        """Per sequence a choice on the host values `means` already holds: no device work."""
        trees, states = [], []
        for trees_s, cache, means_s in zip(drafted, caches, means, strict=True):
            confidences, entropies = zip(*means_s)
            best = max(range(len(trees_s)), key=lambda i: (confidences[i], -i))  # ties -> lowest index
            trees.append(trees_s[best])
            states.append(replace(cache, last_head=best, confidences=confidences, entropies=entropies))
        return trees, states


@dataclass
class EntropyRouted(OverParts):
    """Per sequence: every part drafts the first tree; the lowest mean node entropy part then drafts alone.

    Ties go to the earlier part. Unlike the reference probe (docs/algorithms.md#entropy-routing), the probe costs no extra target prefill
    and consumes no extra randomness: it is the sequence's first drafting step, from the root the loop sampled.
    """

    name: str = "entropy-routed"

    def propose_batch(
        self, states: list[RouterState], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> tuple[list[DraftTree], list[RouterState]]:
        """Sequences yet to choose probe with every part, the others draft with their chosen part; each part
        drafts all of its sequences in one call, and the trees' means are read once per group."""
        trees: list[DraftTree | None] = [None] * len(states)
        out: list[RouterState | None] = [None] * len(states)
        probing = [s for s, state in enumerate(states) if state.chosen is None]
        if probing:
            drafted, parts = _draft_parts(self.parts, [states[s].parts for s in probing],
                                          [features[s] for s in probing], [next_tokens[s] for s in probing])
            for s, probe, part_states, means in zip(probing, drafted, parts, stack_means(stack_trees(drafted))):
                confidences, entropies = zip(*means)
                chosen = min(range(len(probe)), key=lambda i: (entropies[i], i))
                kept = tuple(p if i == chosen else None for i, p in enumerate(part_states))  # drop the others' caches
                trees[s] = probe[chosen]
                out[s] = RouterState(parts=kept, last_head=chosen, chosen=chosen, confidences=confidences,
                                     entropies=entropies)
        nan = float("nan")
        for chosen, part in enumerate(self.parts):
            group = [s for s, state in enumerate(states) if state.chosen == chosen]
            if not group:
                continue
            drafted, part_states = part.propose_batch([states[s].parts[chosen] for s in group],
                                                 [features[s] for s in group], [next_tokens[s] for s in group])
            means = stack_means(stack_trees([[tree] for tree in drafted]))
            for s, tree, part_state, ((confidence, entropy),) in zip(group, drafted, part_states, means):
                only = range(len(self.parts))
                trees[s] = tree
                out[s] = RouterState(
                    parts=tuple(part_state if i == chosen else None for i in only),
                    last_head=chosen,
                    chosen=chosen,
                    confidences=tuple(confidence if i == chosen else nan for i in only),
                    entropies=tuple(entropy if i == chosen else nan for i in only),
                )
        return trees, out


# --- merged trees (docs/algorithms.md#merged-tree-verification) ---------------------------------------------


def split_budget(budget: int, weights: Sequence[float]) -> list[int]:
    """Split `budget` nodes in proportion to `weights`, at least 1 each when budget allows (largest remainder).

    Ties go to the earlier part. Non-positive or non-finite total weight splits evenly.
    """
    n = len(weights)
    w = [max(float(x), 0.0) if math.isfinite(x) else 0.0 for x in weights]
    if sum(w) <= 0:
        w = [1.0] * n
    order = sorted(range(n), key=lambda i: (-w[i], i))
    if budget < n:
        shares = [0] * n
        for i in order[:budget]:
            shares[i] = 1
        return shares
    rest = budget - n
    raw = [rest * x / sum(w) for x in w]
    shares = [1 + int(math.floor(r)) for r in raw]
    left = budget - sum(shares)
    by_fraction = sorted(range(n), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in by_fraction[:left]:
        shares[i] += 1
    return shares


@dataclass
class Merged(AllPartsDrafting):
    """Every part drafts from the same inputs; their trees are verified together as one tree (last_head = -1).

    mode (drafting/tree_merge.py): "concat" (the reference merge), "dedup" (trie merge), "budget" (one single-tree budget of
    `budget` drafted nodes split by mean confidence, then trie-merged) or "rank" (the `budget` most confident
    nodes of all trees, `rank_merge`: for parts of different kinds, such as a head and n-gram lookup).
    """

    mode: str = "concat"
    budget: int | None = None
    name: str = "merged"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown merge mode {self.mode!r}; use concat, dedup, budget or rank")
        if self.mode in ("budget", "rank") and (self.budget is None or self.budget < 1):
            raise ValueError(f"merge mode {self.mode!r} needs a node budget of at least 1")
        super().__post_init__()

    initial_head: ClassVar[int] = -1

    def combine(self, stack: TreeStack, drafted: list[list[DraftTree]], caches: list[RouterState],
                means: list[list[tuple[float, float]]]) -> tuple[list[DraftTree], list[RouterState]]:
        """Every sequence's merged tree in one batched merge on the device (`tree_merge.merge_stack`)."""
        budget_shares = None
        if self.mode == "budget":
            budget_shares = [split_budget(self.budget, [c for c, _ in means_s]) for means_s in means]
        trees, shares = merge_stack(stack, self.mode, self.budget, budget_shares)
        states = [replace(cache, last_head=-1, confidences=tuple(c for c, _ in means_s),
                          entropies=tuple(e for _, e in means_s), shares=shares_s)
                  for cache, means_s, shares_s in zip(caches, means, shares, strict=True)]
        return trees, states


# --- builders (named in drafting/registry.py) ----------------------------------------------------------------


def first_two(heads: dict[str, DraftHead], name: str) -> list[tuple[str, DraftHead]]:
    if len(heads) < 2:
        raise ValueError(
            f"proposer {name!r} combines two heads (A = first, B = second in config order) but got "
            f"{len(heads)}: {list(heads)}; train at least two mixtures (train.mixtures)"
        )
    return list(heads.items())[:2]


def single_heads(pairs: Sequence[tuple[str, DraftHead]], context: DraftContext, tree: TreeConfig) -> list[Proposer]:
    return [SingleHead(name, head, context, tree) for name, head in pairs]


def build_averaged(
    heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig, w: float = 0.5, name: str = "averaged"
) -> Proposer:
    """`averaged-w{w}`: one head whose weights are w·A + (1−w)·B (w = weight of head A)."""
    (_, a), (_, b) = first_two(heads, name)
    if w in (0.0, 1.0):  # the average is exactly one of the heads: share its weights instead of copying
        return SingleHead(name, a if w == 1.0 else b, context, tree)
    return SingleHead(name, average_heads(a, b, w), context, tree)


def build_confidence_routed(heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig) -> Proposer:
    return ConfidenceRouted(single_heads(first_two(heads, "confidence-routed"), context, tree))


def build_entropy_routed(heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig) -> Proposer:
    """Candidates as `names.entropy_candidates`: every head, then the averaged head when there are two."""
    if not heads:
        raise ValueError("proposer 'entropy-routed' needs at least one head")
    parts = single_heads(list(heads.items()), context, tree)
    if len(heads) >= 2:
        parts.append(build_averaged(heads, context, tree))
    return EntropyRouted(parts)


def build_merged(heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig) -> Proposer:
    return Merged(single_heads(first_two(heads, "merged"), context, tree), mode="concat", name="merged")


def build_merged_dedup(heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig) -> Proposer:
    return Merged(single_heads(first_two(heads, "merged-dedup"), context, tree), mode="dedup", name="merged-dedup")


def build_merged_budget(heads: dict[str, DraftHead], context: DraftContext, tree: TreeConfig) -> Proposer:
    parts = single_heads(first_two(heads, "merged-budget"), context, tree)
    return Merged(parts, mode="budget", budget=tree.total_token - 1, name="merged-budget")


def with_ngram(inner: Proposer, tree: TreeConfig, name: str) -> Proposer:
    """`<proposer>+ngram`: `inner`'s tree and a prompt-lookup chain, ranked into the single-head node budget."""
    return Merged([inner, NgramProposer()], mode="rank", budget=tree.total_token - 1, name=name)
