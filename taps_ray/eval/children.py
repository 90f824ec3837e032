"""What a tree node's children accept at T > 0, per position: deterministic top-k children against one child
sampled from the draft (docs/algorithms.md#sampling-and-losslessness; benchmarks/training/children_acceptance.py).

Our trees take a node's children as the head's top-k tokens (draft probability treated as q = 1), so with the
target's processed distribution p at the node, some child is accepted with probability Σ_{c in top-k(q)} p(c).
SpecInfer / EAGLE's reference sampling draws a child x ~ q and accepts it with min(1, p(x)/q(x)), which accepts
with probability Σ_x min(p(x), q(x)). Both are lossless; they differ in how often a node's subtree survives.
"""

from __future__ import annotations

import torch


def children_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_det(k), A_sampled) per row of target probabilities `p` [N, V] and draft probabilities `q` [N, V] over
    the same ids: the target's mass on q's k most likely tokens, and the overlap Σ_x min(p(x), q(x))."""
    if p.shape != q.shape:
        raise ValueError(f"p {tuple(p.shape)} and q {tuple(q.shape)} must be over the same rows and ids")
    top = q.topk(min(k, q.shape[-1]), dim=-1).indices
    return p.gather(-1, top).sum(-1), torch.minimum(p, q).sum(-1)
