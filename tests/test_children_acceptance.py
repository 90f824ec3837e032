"""The depth-1 children arithmetic of benchmarks/training/children_acceptance.py (taps_ray/eval/children.py) on
distributions small enough to check by hand, and the pooled mean its report prints."""

from __future__ import annotations

import pytest
import torch

from taps_ray.eval.children import children_acceptance
from taps_ray.report.uncertainty import pooled_mean


def test_hand_computed_rows():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.2, 0.6, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]])
    top1, sampled = children_acceptance(p, q, 1)
    # row 0: q's argmax is id 1 (p 0.3); overlap min(.5,.2)+min(.3,.6)+min(.2,.1)+min(0,.1) = 0.6
    # row 1: q's argmax is id 0 (p 0.1); overlap 0.1+0.1+0.1+0.1 = 0.4
    assert top1.tolist() == pytest.approx([0.3, 0.1])
    assert sampled.tolist() == pytest.approx([0.6, 0.4])
    top2, _ = children_acceptance(p, q, 2)  # q's top two: ids {1, 0} and {0, one of the 0.1 ties}
    assert top2[0].item() == pytest.approx(0.8)
    assert top2[1].item() == pytest.approx(0.2)


def test_extremes():
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0, 0.0, 0.0]])
    disjoint = torch.tensor([[0.0, 0.0, 0.0, 0.2, 0.3, 0.5]])
    _, same = children_acceptance(p, p.clone(), 1)
    assert same.item() == pytest.approx(1.0)  # q = p: the ratio test always accepts
    top, none = children_acceptance(p, disjoint, 3)
    assert none.item() == 0.0 and top.item() == 0.0  # no shared support: nothing is ever accepted
    everything, _ = children_acceptance(p, disjoint, p.shape[-1])
    assert everything.item() == pytest.approx(1.0)  # every token a child: the target's pick is always one


def test_never_above_one():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(64, 50, generator=generator), dim=-1)
    q = torch.softmax(3 * torch.randn(64, 50, generator=generator), dim=-1)
    for k in (1, 4, 50):
        det, sampled = children_acceptance(p, q, k)
        assert (det <= 1 + 1e-6).all() and (sampled <= 1 + 1e-6).all()
        assert (det >= 0).all() and (sampled >= 0).all()


def test_shapes_must_match():
    with pytest.raises(ValueError, match="same rows and ids"):
        children_acceptance(torch.ones(2, 3) / 3, torch.ones(2, 4) / 4, 1)


def test_pooled_mean_weighs_questions_by_their_positions():
    interval = pooled_mean([1.0, 3.0], [1, 3])  # 4 positions, all accepted
    assert interval.delta == pytest.approx(1.0) and interval.low == interval.high == pytest.approx(1.0)
    spread = pooled_mean([0.0, 3.0], [1, 3])
    assert spread.delta == pytest.approx(0.75) and spread.low == 0.0 and spread.high == 1.0
