"""The parts' trees of a batch of sequences, stacked on the device: what routers and merged trees read.

A combination drafts P trees (one per part) for each of B sequences. Stacked right-padded as [B, P, W] tensors in
a fixed number of ops whatever B and P (every field's nodes concatenated and scattered into place), the trees'
means, path comparisons and merges run as batched tensor code (drafting/tree_merge.py) instead of Python per
sequence and per node, and the host reads the device once per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from taps_ray.drafting.tree import DraftTree, tree_structure, trees_to
from taps_ray.syncs import to_device


@dataclass
class TreeStack:
    """B sequences' P trees right-padded to W nodes. Node j of a tree sits at column j; confidence and entropy
    are per node too (0 at the root and the pads), tokens and parents -1 at the pads (parents -1 at the roots)."""

    tokens: torch.Tensor  # [B, P, W] long
    parents: torch.Tensor  # [B, P, W] long
    confidence: torch.Tensor  # [B, P, W] float32
    entropy: torch.Tensor  # [B, P, W] float32
    sizes: list[list[int]]  # host: sizes[b][p], each tree's node count

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.tokens.shape)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def real(self) -> torch.Tensor:
        """[B, P, W] bool: the trees' nodes (not pads)."""
        sizes = to_device(self.sizes, self.device, torch.long)
        return torch.arange(self.shape[2], device=self.device) < sizes[..., None]

    def structure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth [B, P, W] and ancestor-and-self mask [B, P, W, W] of every tree (pads: their own roots)."""
        batch, parts, width = self.shape
        depth, mask = tree_structure(self.parents.view(batch * parts, width))
        return depth.view(batch, parts, width), mask.view(batch, parts, width, width)


def stack_trees(trees: Sequence[Sequence[DraftTree]]) -> TreeStack:
    """`trees[b][p]`, every sequence's parts' trees, stacked on the first tree's device (a part drafting
    elsewhere, such as prompt lookup on the features' device, is moved there): per field one concatenation of
    every tree's nodes, scattered in row-major order into the pads (`masked_scatter_`), whatever the batch."""
    device = trees[0][0].tokens.device
    flat = trees_to([t for row in trees for t in row], device)
    width = max(t.size for t in flat)
    columns = torch.arange(width, device=device)
    node = columns < to_device([t.size for t in flat], device, torch.long)[:, None]  # [B*P, W]
    drafted = node & (columns > 0)  # the roots carry no confidence or entropy

    def placed(name: str, where: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
        values = torch.cat([getattr(t, name) for t in flat]).to(dtype)
        out = torch.full((len(flat), width), fill, dtype=dtype, device=device).masked_scatter_(where, values)
        return out.view(len(trees), -1, width)

    return TreeStack(
        tokens=placed("tokens", node, -1, torch.long),
        parents=placed("parents", node, -1, torch.long),
        confidence=placed("confidence", drafted, 0.0, torch.float32),
        entropy=placed("entropy", drafted, 0.0, torch.float32),
        sizes=[[t.size for t in row] for row in trees],
    )


def stack_means(stack: TreeStack) -> list[list[tuple[float, float]]]:
    """Per sequence, each part's (mean node confidence, mean node entropy), 0 for a root-only tree (as
    `DraftTree.mean_confidence` says), in one device-to-host read for the batch."""
    counts = to_device([[max(n - 1, 1) for n in row] for row in stack.sizes], stack.device, torch.float64)
    sums = torch.stack([stack.confidence.sum(-1), stack.entropy.sum(-1)], dim=-1).double()
    return [[(c, e) for c, e in row] for row in (sums / counts[..., None]).tolist()]
