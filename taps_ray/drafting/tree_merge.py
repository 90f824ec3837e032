"""Merged trees (docs/algorithms.md#merged-tree-verification), for a batch of sequences at once on the device.

Every sequence's parts' trees (a `TreeStack`) become one tree each, under the shared root, nodes in concatenation
order (tree 0's, then tree 1's, ...), each node keeping the statistics and `source` (its tree's index) of the
first node that drafted its path:
* `concat`, the reference merge: every node as it is (duplicates of other trees' nodes stay);
* `dedup`, a trie merge: a node repeating a path already in the tree is drafted once;
* `budget`: tree p adds its most confident nodes (`path_scores`' order) until it has added `shares[p]` new paths,
  the budget left over filled round-robin from the trees' next nodes, then trie-merged;
* `rank`: the `budget` most confident distinct paths over all trees (ties to the earlier tree), trie-merged.

Why tensors: the reference walks every node of every sequence in Python. Here whether two nodes spell the same
token path is one product of ancestor matrices (`stack_paths`), a trie merge keeps the first node of each path,
and the greedy takes of the budget and rank merges become counts over a total order of the nodes ("how many new
paths come before this node"): one pass for a rank merge, one per part plus one for the round robin for a budget
merge. Loops run over parts, never over sequences or nodes; the host reads the device once per batch (the
merged trees' sizes, and the rank merge's counts), not at all for the reference merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from taps_ray.drafting.tree import DraftTree, trees_from_rows
from taps_ray.drafting.tree_stack import TreeStack, stack_trees
from taps_ray.syncs import to_device

MODES = ("concat", "dedup", "budget", "rank")


@dataclass
class StackPaths:
    """A stack's nodes flattened per sequence: N = P·W, node j of tree p at p·W + j, so flat order is
    concatenation order."""

    parts: int  # P
    part: torch.Tensor  # [N] long, each node's tree
    real: torch.Tensor  # [B, N] bool, the trees' nodes
    root: torch.Tensor  # [B, N] bool, the trees' roots
    same: torch.Tensor  # [B, N, N] bool, nodes i and j spell the same token path from the root
    order: torch.Tensor  # [B, N] long, each node's place in the ranking (`path_scores` descending, ties to the
    # earlier tree, then the lower index); roots and pads last

    @property
    def drafted(self) -> torch.Tensor:
        return self.real & ~self.root


def stack_paths(stack: TreeStack) -> StackPaths:
    """The paths of every node of a stack. Two nodes spell the same path when they have one depth and their
    ancestors agree in token at every depth: the number of depths where they agree is a sum over pairs of
    ancestors, `ancestors · match · ancestorsᵀ` (exact: small integers)."""
    batch, parts, width = stack.shape
    nodes = parts * width
    depth, ancestors = stack.structure()
    columns = torch.arange(width, device=stack.device)
    real = stack.real()
    flat_depth, flat_real = depth.view(batch, nodes), real.view(batch, nodes)
    tokens = stack.tokens.view(batch, nodes)
    match = ((flat_depth[:, :, None] == flat_depth[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
             & flat_real[:, :, None] & flat_real[:, None, :])
    a = ancestors.float()
    agree = torch.einsum("bpik,bpkql,bqjl->bpiqj", a, match.view(batch, parts, width, parts, width).float(), a)
    same = (agree.reshape(batch, nodes, nodes) == (flat_depth + 1)[:, :, None].float()) & match
    # path_scores: the smallest confidence on the path below the root
    on_path = ancestors & (columns > 0)
    score = torch.where(on_path, stack.confidence[:, :, None, :], torch.inf).amin(-1).view(batch, nodes)
    flat = torch.arange(nodes, device=stack.device)
    root = flat_real & (flat % width == 0)
    ranking = torch.where(flat_real & ~root, -score, torch.inf).sort(dim=-1, stable=True).indices
    order = torch.empty_like(ranking).scatter_(1, ranking, flat.expand(batch, -1))
    part = flat.div(width, rounding_mode="floor")
    return StackPaths(parts=parts, part=part, real=flat_real, root=root, same=same, order=order)


def _take(paths: StackPaths, order: torch.Tensor, candidates: torch.Tensor, kept: torch.Tensor,
          limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's greedy take, all at once: walking `candidates` [B, N] in `order`, each is taken while
    fewer than `limit` [B] of those taken before it added a path not in `kept`. Returns the taken nodes and
    those of them that added a new path."""
    earlier = order[:, None, :] < order[:, :, None]  # [B, i, j]: j comes before i
    present = (paths.same & kept[:, None, :]).any(-1)
    repeated = (paths.same & earlier & candidates[:, None, :]).any(-1)
    new = candidates & ~present & ~repeated
    before = (earlier & new[:, None, :]).sum(-1)
    taken = candidates & (before < limit[:, None])
    return taken, taken & new


def rank_kept(paths: StackPaths, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes a rank merge keeps [B, N] and each tree's count of new paths [B, P]."""
    batch = paths.real.shape[0]
    limit = torch.full((batch,), budget, dtype=torch.long, device=paths.real.device)
    taken, new = _take(paths, paths.order, paths.drafted, paths.root, limit)
    return paths.root | taken, new.view(batch, paths.parts, -1).sum(-1)


def budget_kept(paths: StackPaths, budget: int, shares: torch.Tensor) -> torch.Tensor:
    """The nodes a budget merge keeps [B, N]: tree p's most confident nodes until it has added shares[:, p] new
    paths (the budget permitting), then round-robin (turn r: every tree's next node, tree order) to the budget."""
    batch, parts = shares.shape
    drafted, kept = paths.drafted, paths.root.clone()
    count = torch.zeros(batch, dtype=torch.long, device=kept.device)
    for p in range(parts):
        limit = torch.minimum(shares[:, p], budget - count)
        taken, new = _take(paths, paths.order, drafted & (paths.part == p), kept, limit)
        kept |= taken
        count += new.sum(-1)
    earlier = paths.order[:, None, :] < paths.order[:, :, None]
    same_part = paths.part[:, None] == paths.part[None, :]
    place = (earlier & same_part & drafted[:, None, :]).sum(-1)  # each node's place in its tree's ranking
    first_turn = (kept & drafted).view(batch, parts, -1).sum(-1)[:, paths.part]  # nodes each tree took
    turn = (place - first_turn) * parts + paths.part
    waiting = drafted & ~kept
    taken, _ = _take(paths, turn, waiting, kept, budget - count)
    return kept | taken


@dataclass
class MergedRows:
    """Every sequence's merged tree, right-padded [B, N] (node fields; the root's confidence, entropy and source
    are pads), and its size [B]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor
    source: torch.Tensor
    sizes: torch.Tensor

    def trees(self, sizes: list[int], chains: list[bool | None]) -> list[DraftTree]:
        """The merged trees (`sizes`: `self.sizes` on the host)."""
        width = max(sizes)
        return trees_from_rows(self.tokens[:, :width], self.parents[:, :width], self.confidence[:, 1:width],
                               self.entropy[:, 1:width], self.source[:, 1:width], sizes=sizes, chains=chains)


def merge_rows(stack: TreeStack, paths: StackPaths | None, kept: torch.Tensor, dedup: bool) -> MergedRows:
    """The merge of each sequence's `kept` nodes [B, N] (closed subtrees, the roots among them): the first
    root is the merged root, the other roots map onto it; with `dedup` (needs `paths`) a node keeps only the
    first node of its path, which the nodes below it hang from."""
    batch, parts, width = stack.shape
    nodes = parts * width
    flat = torch.arange(nodes, device=stack.device)
    root = (flat % width == 0).expand(batch, -1)
    out = kept & (~root | (flat == 0))
    if dedup:
        first = torch.where(paths.same & kept[:, None, :], flat, nodes).amin(-1)
        out &= first == flat
    else:
        first = torch.where(root, 0, flat)
    index = out.cumsum(-1) - 1
    part = flat.div(width, rounding_mode="floor")
    parent = (part * width + stack.parents.view(batch, nodes)).clamp(min=0)
    parents = torch.where(root, -1, index.gather(1, first.clamp(max=nodes - 1).gather(1, parent)))  # dropped: any
    at = torch.where(out, index, nodes)  # dropped nodes go to a spare column

    def placed(values: torch.Tensor, fill: float) -> torch.Tensor:
        spare = torch.full((batch, nodes + 1), fill, dtype=values.dtype, device=values.device)
        return spare.scatter_(1, at, values)[:, :nodes]

    return MergedRows(
        tokens=placed(stack.tokens.view(batch, nodes), -1),
        parents=placed(parents, -1),
        confidence=placed(stack.confidence.view(batch, nodes), 0.0),
        entropy=placed(stack.entropy.view(batch, nodes), 0.0),
        source=placed(part.expand(batch, -1), 0),
        sizes=out.sum(-1),
    )


def merge_stack(stack: TreeStack, mode: str, budget: int | None = None,
                shares: Sequence[Sequence[int]] | None = None) -> tuple[list[DraftTree], list[tuple[int, ...]]]:
    """Every sequence's merged tree (`mode`, one of `MODES`), and per sequence the nodes each tree added (rank;
    budget: `shares[b]` as given; else empty). One host read for the batch, none for `concat`."""
    if mode not in MODES:
        raise ValueError(f"unknown merge mode {mode!r}; use {', '.join(MODES)}")
    batch, parts, _ = stack.shape
    if mode == "concat":
        rows = merge_rows(stack, None, stack.real().view(batch, -1), dedup=False)
        sizes = [1 + sum(n - 1 for n in row) for row in stack.sizes]
        drafting = [sum(n > 1 for n in row) for row in stack.sizes]
        chains = [True if d == 0 else False if d > 1 else None for d in drafting]  # one tree: its own (read later)
        return rows.trees(sizes, chains), [()] * batch
    paths = stack_paths(stack)
    added = torch.zeros(batch, parts, dtype=torch.long, device=stack.device)
    if mode == "dedup":
        kept = paths.real
    elif mode == "rank":
        kept, added = rank_kept(paths, budget)
    else:
        kept = budget_kept(paths, budget, to_device(list(map(list, shares)), stack.device, torch.long))
    rows = merge_rows(stack, paths, kept, dedup=True)
    columns = torch.arange(rows.parents.shape[1], device=stack.device)
    chain = ((rows.parents == columns - 1) | (columns >= rows.sizes[:, None])).all(-1)
    read = torch.cat([rows.sizes[:, None], chain[:, None].long(), added], dim=1).tolist()  # the one read
    trees = rows.trees([r[0] for r in read], [bool(r[1]) for r in read])
    counts = [tuple(r[2:]) for r in read] if mode == "rank" else [tuple(s) for s in shares or [()] * batch]
    return trees, counts


# --- one sequence's trees (the reference's signatures) -------------------------------------------------------


def _stacked(trees: Sequence[DraftTree]) -> TreeStack:
    """One sequence's trees as a stack, checked to share the root."""
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    stack = stack_trees([trees])
    roots = stack.tokens[0, :, 0].tolist()
    if len(set(roots)) > 1:
        raise ValueError(f"merged trees must share the root; got roots {roots}")
    return stack


def merge_trees(trees: Sequence[DraftTree], dedup: bool = False) -> DraftTree:
    """All trees under one shared root (`concat`, or `dedup`: the trie merge); `source` is each node's tree."""
    (tree,), _ = merge_stack(_stacked(trees), "dedup" if dedup else "concat")
    return tree


def budget_merge(trees: Sequence[DraftTree], budget: int, shares: Sequence[int]) -> DraftTree:
    """A trie-merged tree of exactly min(budget, distinct paths) drafted nodes, tree i adding its most confident
    nodes until it has added shares[i] new paths, the rest round-robin."""
    (tree,), _ = merge_stack(_stacked(trees), "budget", budget, [shares])
    return tree


def rank_merge(trees: Sequence[DraftTree], budget: int) -> tuple[DraftTree, tuple[int, ...]]:
    """A trie-merged tree of the `budget` most confident distinct paths over all trees, and each tree's count of
    the new paths it added. With confidences that estimate a node's chance of being accepted (an EAGLE head's
    cumulative probability, an n-gram chain's calibrated rate^depth), the budget goes where the expected
    accepted length grows most, whichever source drafted the node."""
    (tree,), (added,) = merge_stack(_stacked(trees), "rank", budget)
    return tree, added
