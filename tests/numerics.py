"""How tests compare two numeric paths that compute the same thing with different kernels.

Two paths are bit-identical only when the code runs the same kernel on the same shapes; the CPU family picks the
kernel (Intel AMX, AVX-512 without AMX, AVX2), so a stacked `bmm` and one head's `mm`, a batch and its rows, or
inductor and eager round differently on some machines and alike on others. Tests therefore compare such paths with
a tolerance derived from fp32 rounding, and compare tokens and tree structure exactly except at a near-tie, where
the two roundings may legitimately rank two almost equal candidates the other way round. Lossless tests never
compare drafting paths: a draft is only a proposal, and the output is checked against the target itself.
"""

from __future__ import annotations

import math

import torch

from taps_ray.drafting.tree import DraftTree


def rounding_rtol(terms: int, chained: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance between two summation orders of `terms`-long dot products, `chained` of them in a row.

    Each order's rounding error is a random walk of about sqrt(terms) steps of one unit in the last place, and a
    chain of reductions (layers, softmax, a product of path probabilities) adds them up; 8 covers the tail and the
    re-association inside vectorised kernels."""
    return 8.0 * chained * math.sqrt(terms) * torch.finfo(dtype).eps


def tree_rtol(hidden_size: int, depth: int) -> float:
    """`rounding_rtol` for a drafted tree's confidences: a node's confidence multiplies the probabilities of its
    ancestors, one head step per level with four reductions over the hidden size (fc, attention, MLP, LM head),
    and a rounding of a log-probability is a relative error of the confidence."""
    return rounding_rtol(hidden_size, chained=4 * (depth + 1))


def assert_same_tree(got: DraftTree, want: DraftTree, rtol: float, entropy_rtol: float | None = None) -> bool:
    """`got` is `want` up to rounding: the same tokens and parents, confidences and entropies within `rtol`; or,
    where they differ, a near-tie. EAGLE-2 ranks candidates by confidence, so two roundings of almost equal
    candidates may keep one for the other (at the selection boundary) or expand one instead of the other (then the
    subtrees below differ). Either way both trees agree, confidence by confidence in descending order, on every
    node above the tie, and `want` holds two nodes there within `rtol` of each other. Returns whether the trees
    differed at such a near-tie, so a caller can bound how often that happens. `entropy_rtol` (default `rtol`):
    an entropy sums over the whole draft vocabulary, so paths that reduce it differently need `rounding_rtol` of
    the vocabulary size."""
    if got.size == want.size and torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents):
        torch.testing.assert_close(got.confidence, want.confidence, rtol=rtol, atol=rtol * 1e-3)
        entropy_rtol = rtol if entropy_rtol is None else entropy_rtol
        torch.testing.assert_close(got.entropy, want.entropy, rtol=entropy_rtol, atol=entropy_rtol)
        return False
    assert bool(got.tokens[0] == want.tokens[0]), "the trees' roots differ: the root is the target's token, not a draft"
    mine = got.confidence.sort(descending=True).values.tolist()
    theirs = want.confidence.sort(descending=True).values.tolist()
    close = [math.isclose(a, b, rel_tol=rtol) for a, b in zip(mine, theirs)]
    agree = close.index(False) if False in close else len(close)  # nodes above the first disagreement
    ties = [i for i in range(min(agree + 1, len(theirs)) - 1) if math.isclose(theirs[i], theirs[i + 1], rel_tol=rtol)]
    assert ties or (agree == len(theirs) == len(mine)), (
        f"trees differ with no near-tie above their first disagreeing confidence (rank {agree}): "
        f"{mine[: agree + 1]} vs {theirs[: agree + 1]} at rtol {rtol:.2e}")
    return True
