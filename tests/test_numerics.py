"""The comparison of two drafting paths (tests/numerics.py) accepts rounding and near-ties, and nothing else."""

from __future__ import annotations

import pytest
import torch

from taps_ray.drafting.tree import build_tree

from numerics import assert_same_tree, rounding_rtol, tree_rtol

PARENTS = torch.tensor([-1, 0, 0, 1])


def _tree(tokens: list[int], confidence: list[float]):
    return build_tree(torch.tensor(tokens), PARENTS, confidence=torch.tensor(confidence),
                      entropy=torch.tensor([1.0, 2.0, 3.0]))


def test_rounding_tolerance_grows_with_the_reduction():
    assert rounding_rtol(64) < rounding_rtol(4096) < rounding_rtol(4096, chained=2)
    assert rounding_rtol(64, dtype=torch.bfloat16) > 1000 * rounding_rtol(64)
    assert tree_rtol(64, 3) < 1e-3  # fp32 at the tiny target's width: still far tighter than any real difference


def test_same_tree_up_to_rounding_passes_and_a_real_difference_fails():
    rtol = tree_rtol(64, 3)
    want = _tree([5, 6, 7, 8], [0.6, 0.3, 0.2])
    assert not assert_same_tree(_tree([5, 6, 7, 8], [0.6 * (1 + rtol / 4), 0.3, 0.2]), want, rtol)
    with pytest.raises(AssertionError):
        assert_same_tree(_tree([5, 6, 7, 8], [0.6 * (1 + 10 * rtol), 0.3, 0.2]), want, rtol)


def test_trees_that_part_need_a_near_tie_above_where_they_part():
    rtol = tree_rtol(64, 3)
    # nodes 2 and 3 swap places at equal confidence: a near-tie
    tied = _tree([5, 6, 7, 8], [0.6, 0.3, 0.3 * (1 - rtol / 4)])
    assert assert_same_tree(_tree([5, 6, 9, 8], [0.6, 0.3 * (1 - rtol / 4), 0.3]), tied, rtol)
    # the same change where the two candidates are far apart is a different tree
    untied = _tree([5, 6, 7, 8], [0.6, 0.3, 0.1])
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_tree(_tree([5, 6, 9, 8], [0.6, 0.3, 0.2]), untied, rtol)
    with pytest.raises(AssertionError, match="roots differ"):
        assert_same_tree(_tree([4, 6, 7, 8], [0.6, 0.3, 0.3]), tied, rtol)
