"""Draft trees: the data every proposer hands to the verifier (EAGLE-2 dynamic tree drafting is drafting/eagle2.py).

A tree is a handful of explicit tensors (tokens, parents, depths, ancestor mask, root-to-leaf retrieve rows,
per-node confidence and entropy), so routers and merged trees are small functions over trees. A tree lives
on the device of the head that drafted it (of its tokens); the verifier moves it to its own (`DraftTree.to`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from taps_ray.syncs import to_device


@dataclass
class DraftTree:
    """Node 0 is the root (the token the target produced last, not yet in its cache).

    Every field is built on the device without reading values back (`tree_structure`), so drafting a batch of
    trees costs the host no sync; `retrieve` (the root-to-leaf rows, whose count depends on the tree) is derived
    on first use (it spells a tree the way EAGLE's reference code does, which tests compare against). `chain`:
    whether every node's parent is the node before it, when the builder knows it without reading the tree (None:
    `is_chain` reads it). `draft_prob`: for acceptance rules that read it (rejection sampling against the draft
    distribution q), the probability the drafter gave each node's token given its parent; None where the drafter
    does not say (the point-mass rule needs none). Pruning and moving a tree keep it; a merge drops it.
    """

    tokens: torch.Tensor  # [T] long
    parents: torch.Tensor  # [T] long, -1 for the root; parents precede children
    depth: torch.Tensor  # [T] long, root = 0
    mask: torch.Tensor  # [T, T] bool, ancestors and self
    confidence: torch.Tensor  # [T-1] float32, cumulative path probability of each drafted node
    entropy: torch.Tensor  # [T-1] float32, entropy (nats) of the distribution each node was drawn from
    source: torch.Tensor = field(default=None)  # [T-1] long, which head drafted each node (merged trees)
    chain: bool | None = None
    draft_prob: torch.Tensor | None = None  # [T-1] float32

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = torch.zeros(self.size - 1, dtype=torch.long, device=self.tokens.device)
        self._retrieve: torch.Tensor | None = None

    @property
    def retrieve(self) -> torch.Tensor:
        """[L, Dmax] long: root-to-leaf node indices, one row per leaf, right-padded with -1, rows in
        lexicographic order (-1 last), so the first row on a tie is the first path in DFS preorder."""
        if self._retrieve is None:
            self._retrieve = _retrieve_rows(self.parents, self.mask)
        return self._retrieve

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it (plain decoding's one-node tree is a chain)."""
        if self.chain is None:
            self.chain = bool((self.parents == torch.arange(-1, self.size - 1, device=self.parents.device)).all())
        return self.chain

    @property
    def mean_confidence(self) -> float:
        return float(self.confidence.mean()) if self.confidence.numel() else 0.0

    @property
    def mean_entropy(self) -> float:
        return float(self.entropy.mean()) if self.entropy.numel() else 0.0


@dataclass
class PaddedTrees:
    """A step's trees right-padded to one width on the device, built once for both the target's inputs and
    acceptance. Rows without a tree (a sequence sitting the step out) are empty; pad nodes have token -1,
    parent and depth 0, and an empty mask row and column."""

    tokens: torch.Tensor  # [B, W] long
    parents: torch.Tensor  # [B, W] long
    depth: torch.Tensor  # [B, W] long
    mask: torch.Tensor  # [B, W, W] bool
    sizes: torch.Tensor  # [B] long, 0 without a tree
    present: list[bool]  # which rows have a tree (host)
    draft_prob: torch.Tensor | None = None  # [B, W] float32 node j's `DraftTree.draft_prob` (1 for roots and
    # pads), when every tree has one

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


def pad_trees(trees: Sequence[DraftTree | None], width: int, device: torch.device | str) -> PaddedTrees:
    """`PaddedTrees` of `trees` (every one on `device`, none wider than `width`)."""
    empty = torch.zeros(0, dtype=torch.long, device=device)

    def padded(name: str, value: int) -> torch.Tensor:
        rows = [empty if t is None else getattr(t, name) for t in trees]
        out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)
        return F.pad(out, (0, width - out.shape[1]), value=value)

    mask = torch.stack([torch.zeros(width, width, dtype=torch.bool, device=device) if t is None
                        else F.pad(t.mask, (0, width - t.size, 0, width - t.size)) for t in trees])
    sizes = to_device([0 if t is None else t.size for t in trees], device)
    return PaddedTrees(padded("tokens", -1), padded("parents", 0), padded("depth", 0), mask, sizes,
                       [t is not None for t in trees], _padded_draft_probs(trees, width, device))


def packed_fields(trees: Sequence[DraftTree | None], rows: int, width: int, device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens and parents [rows, width] (pads -1) and sizes [rows] of `trees` (padded with empty rows to `rows`),
    in a fixed number of ops whatever the batch: the nodes of all trees concatenated and scattered into place
    (`pad_trees` pads each tree: a few ops per tree). Depths and masks follow from the parents on the device
    (`tree_structure`), as a captured step computes them."""
    present = [t for t in trees if t is not None]
    sizes = [0 if t is None else t.size for t in trees] + [0] * (rows - len(trees))
    at = [(b, j) for b, size in enumerate(sizes) for j in range(size)]
    index = to_device([[b for b, _ in at], [j for _, j in at]], device, torch.long)
    fields = []
    for name in ("tokens", "parents"):
        flat = torch.cat([getattr(t, name) for t in present])
        fields.append(torch.full((rows, width), -1, dtype=torch.long, device=device).index_put_((index[0], index[1]),
                                                                                               flat))
    return fields[0], fields[1], to_device(sizes, device, torch.long)


def _padded_draft_probs(trees: Sequence[DraftTree | None], width: int, device: torch.device | str
                        ) -> torch.Tensor | None:
    """`PaddedTrees.draft_prob`, or None when a tree carries none."""
    present = [t for t in trees if t is not None]
    if not present or any(t.draft_prob is None for t in present):
        return None
    one = torch.ones(1, dtype=torch.float32, device=device)
    rows = [one if t is None else torch.cat([one, t.draft_prob.float()]) for t in trees]
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=1.0)
    return F.pad(out, (0, width - out.shape[1]), value=1.0)


def trees_to(trees: Sequence[DraftTree | None], device: torch.device | str) -> list[DraftTree | None]:
    """A batch of trees (None kept) on `device` in three copies — the integer fields, the float fields and
    the masks of every tree, each flattened into one tensor — instead of one per field and tree: a GPU drafter
    that ships its trees to a target worker, and the worker that takes them in, sync three times per step."""
    device = torch.device(device)
    moving = [t for t in trees if t is not None and t.tokens.device != device]
    if not moving:
        return list(trees)
    ints = torch.cat([torch.cat([t.tokens, t.parents, t.depth, t.source]) for t in moving]).to(device)
    floats = torch.cat([torch.cat([t.confidence, t.entropy]) for t in moving]).to(device)
    masks = torch.cat([t.mask.flatten() for t in moving]).to(device)
    sizes = [t.size for t in moving]
    int_parts = ints.split([4 * n - 1 for n in sizes])
    float_parts = floats.split([2 * (n - 1) for n in sizes])
    mask_parts = masks.split([n * n for n in sizes])
    moved = {}
    for t, n, i, f, m in zip(moving, sizes, int_parts, float_parts, mask_parts):
        tokens, parents, depth, source = i.split([n, n, n, n - 1])
        confidence, entropy = f.split([n - 1, n - 1])
        draft_prob = None if t.draft_prob is None else t.draft_prob.to(device)
        moved[id(t)] = DraftTree(tokens, parents, depth, m.view(n, n), confidence, entropy, source, t.chain, draft_prob)
    return [None if t is None else moved.get(id(t), t) for t in trees]


def tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth [R, T] and ancestor-and-self mask [R, T, T] of R trees of T nodes from their parent pointers
    [R, T] (-1: the root), on the device in a fixed number of passes: the mask is the reflexive-transitive
    closure of the parent relation, by repeated squaring (paths of up to 2^i edges after i squarings)."""
    size = parents.shape[-1]
    nodes = torch.arange(size, device=parents.device)
    reach = (parents[..., None] == nodes) | torch.eye(size, dtype=torch.bool, device=parents.device)
    closure = reach.float()
    for _ in range(max(size - 1, 1).bit_length()):
        closure = (closure @ closure).clamp_(max=1.0)
    mask = closure > 0
    return mask.sum(-1) - 1, mask


def _retrieve_rows(parents: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`DraftTree.retrieve` from a tree's parents and mask (read on the host: the row count is the leaf count)."""
    device, mask, parents = parents.device, mask.cpu(), parents.cpu()
    host, size = mask.device, mask.shape[0]
    is_parent = torch.zeros(size, dtype=torch.bool, device=host)
    is_parent[parents[1:]] = True
    leaves = (~is_parent).nonzero().flatten()
    width = int(mask.sum(-1).max())
    # each leaf's ancestors in index order (= root-to-leaf order); `size` pads, so it sorts after every node
    rows = torch.where(mask[leaves], torch.arange(size, device=host), size).sort(dim=-1).values[:, :width]
    order = torch.arange(len(leaves), device=host)
    for column in reversed(range(width)):  # lexicographic: stable sorts from the last column to the first
        order = order[rows[order, column].sort(stable=True).indices]
    rows = rows[order]
    return rows.masked_fill(rows == size, -1).to(device)


def build_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    confidence: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    source: torch.Tensor | None = None,
    draft_prob: torch.Tensor | None = None,
) -> DraftTree:
    """A tree from parent pointers, checked (parents must precede children; reading them syncs once): for
    proposers that build trees node by node. Drafters that produce valid trees by construction use
    `trees_from_rows`."""
    parent_list = parents.tolist()
    if parent_list[0] != -1 or any(not (0 <= p < i) for i, p in enumerate(parent_list) if i):
        raise ValueError(f"invalid tree: node 0 must be the root and every parent must precede its child: {parent_list}")
    device = tokens.device
    size = int(tokens.numel())
    chain = parent_list == list(range(-1, size - 1))
    empty = torch.zeros(size - 1, dtype=torch.float32, device=device)
    (tree,) = trees_from_rows(
        tokens.long()[None], parents.long().to(device)[None],
        (empty if confidence is None else confidence.float().to(device))[None],
        (empty if entropy is None else entropy.float().to(device))[None],
        None if source is None else source.to(device)[None], chains=[chain],
    )
    tree.draft_prob = None if draft_prob is None else draft_prob.float().to(device)
    return tree


def trees_from_rows(
    tokens: torch.Tensor, parents: torch.Tensor, confidence: torch.Tensor, entropy: torch.Tensor,
    source: torch.Tensor | None = None, sizes: list[int] | None = None, chains: list[bool] | None = None,
) -> list[DraftTree]:
    """R trees from [R, T] tokens and parents (root first) and [R, T-1] node confidences and entropies, their
    structure built in one batched pass (`tree_structure`); tree r keeps its first `sizes[r]` nodes (default
    all). The trees are views of the batched tensors. `chains`: each tree's `DraftTree.chain`, if known."""
    depth, mask = tree_structure(parents)
    rows, width = tokens.shape
    sizes = [width] * rows if sizes is None else sizes
    chains = [None] * rows if chains is None else chains
    return [
        DraftTree(tokens=tokens[r, :n], parents=parents[r, :n], depth=depth[r, :n], mask=mask[r, :n, :n],
                  confidence=confidence[r, : n - 1], entropy=entropy[r, : n - 1],
                  source=None if source is None else source[r, : n - 1], chain=chains[r])
        for r, n in enumerate(sizes)
    ]


def path_scores(tree: DraftTree) -> list[float]:
    """Per node, the smallest confidence on its path (its own for EAGLE trees and n-gram chains, whose
    cumulative confidences never grow with depth); inf for the root."""
    parents = tree.parents.tolist()
    score = [math.inf] * tree.size
    conf = tree.confidence.tolist()
    for j in range(1, tree.size):
        score[j] = min(conf[j - 1], score[parents[j]])
    return score


def ranked_nodes(tree: DraftTree) -> list[int]:
    """Drafted node indices, most confident first (`path_scores`, ties to the lower index, so a parent always
    ranks before its child); any prefix of this list is a closed subtree."""
    score = path_scores(tree)
    return sorted(range(1, tree.size), key=lambda j: (-score[j], j))


def prune_tree(tree: DraftTree, n: int) -> DraftTree:
    """The subtree of the n most confident drafted nodes (see `ranked_nodes`), in the original node order."""
    keep = sorted(ranked_nodes(tree)[: max(n, 0)])
    return subtree(tree, keep)


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The tree of the root and the drafted nodes `keep` (each kept node's parent kept too), in node order."""
    nodes = [0] + sorted(keep)
    new_index = {old: new for new, old in enumerate(nodes)}
    parents = tree.parents.tolist()
    device = tree.tokens.device
    drafted = to_device(nodes[1:], device, torch.long) - 1
    return build_tree(
        tree.tokens[nodes],
        to_device([-1] + [new_index[parents[j]] for j in nodes[1:]], device),
        confidence=tree.confidence[drafted],
        entropy=tree.entropy[drafted],
        source=tree.source[drafted],
        draft_prob=None if tree.draft_prob is None else tree.draft_prob[drafted],
    )


def root_only(root: int | torch.Tensor, device: torch.device | str) -> DraftTree:
    """The degenerate tree of plain autoregressive decoding: verify the root, accept nothing drafted. `root` may
    be a one-element tensor (no host read)."""
    tokens = root.reshape(1).long().to(device) if isinstance(root, torch.Tensor) else to_device([root], device)
    empty = torch.zeros(0, dtype=torch.float32, device=device)
    return DraftTree(tokens=tokens, parents=torch.full((1,), -1, dtype=torch.long, device=device),
                     depth=torch.zeros(1, dtype=torch.long, device=device),
                     mask=torch.ones(1, 1, dtype=torch.bool, device=device), confidence=empty, entropy=empty,
                     chain=True)
