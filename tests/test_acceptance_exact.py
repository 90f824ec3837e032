"""The T > 0 acceptance rule, checked exactly: the output of `PointMass.verdicts` is a function of one uniform per
depth, piecewise constant between the nodes' cumulative-probability boundaries, so every piece is verified (one
batch row each) with its exact probability and the output distribution is computed, not sampled: a broken rule
fails every time. The sampler's uniforms are checked against a plain-Python splitmix64 and for uniformity."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

import taps_ray.decoding.verify as verify
from taps_ray.decoding.verify import POINT_MASS, SamplingParams, position_uniforms, processed_probs
from taps_ray.drafting.tree import build_tree

V = 4
# Root 0; first level 3, 1, 3 (a duplicate, as merged trees have), 2; under node 1 (3): 1, 0; under node 2 (1): 3.
TREE = build_tree(torch.tensor([0, 3, 1, 3, 2, 1, 0, 3]), torch.tensor([-1, 0, 0, 0, 0, 1, 1, 2]))
ROOT_LOGITS = torch.tensor([0.3, 1.1, -0.4, 0.8])
CHILD_LOGITS = {3: torch.tensor([0.9, -0.2, 0.5, 0.1]), 1: torch.tensor([-0.7, 0.4, 1.3, 0.0]),
                2: torch.tensor([0.2, 0.2, -1.0, 0.6])}
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(top_k=2,
                                                                                                   temperature=1.3)]


def _logits() -> torch.Tensor:
    """Per-node target logits; a node's logits depend on its path only (the duplicate 3 shares node 1's)."""
    rows = [ROOT_LOGITS]
    for node in range(1, TREE.size):
        token, depth = int(TREE.tokens[node]), int(TREE.depth[node])
        rows.append(CHILD_LOGITS[token] if depth == 1 else torch.tensor([0.1 * node, -0.3, 0.2, 0.05 * node]))
    return torch.stack(rows)


def exact_outputs(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(emitted tokens) of one `PointMass.verdicts` verdict over the uniforms of depths 0..D: each depth's [0, 1) cut at
    every node's cumulative probabilities at that depth, one batch row per combination of pieces (its midpoints)."""
    logits = _logits()
    cdf = processed_probs(logits, params).double().cumsum(-1)
    pieces = []  # per depth: (midpoint, length) of each piece
    for depth in range(int(TREE.depth.max()) + 1):
        level = cdf[TREE.depth == depth]
        cuts = torch.cat([torch.tensor([0.0, 1.0], dtype=torch.float64), (level / level[:, -1:]).flatten()])
        cuts = cuts.clamp(0, 1).unique().sort().values
        pieces.append([(float(a + b) / 2, float(b - a)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a])
    combos = list(itertools.product(*pieces))
    uniforms = torch.tensor([[mid for mid, _ in combo] + [0.5] * (TREE.size - len(combo)) for combo in combos],
                            dtype=torch.float64)
    verdicts = POINT_MASS.verdicts([TREE] * len(combos), logits.expand(len(combos), -1, -1), [params] * len(combos), uniforms)
    outcomes: dict[tuple[int, ...], float] = {}
    for combo, verdict in zip(combos, verdicts):
        emitted = tuple(verdict.tokens[1:] + [verdict.bonus])
        weight = 1.0
        for _, length in combo:
            weight *= length
        outcomes[emitted] = outcomes.get(emitted, 0.0) + weight
    return outcomes


def lossless_error(outcomes: dict[tuple[int, ...], float], params: SamplingParams) -> float:
    """Largest gap between the enumerated distributions and the target's: of the first emitted token, and of the
    second given an accepted first token (its node's distribution)."""
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, V, dtype=torch.float64)
    for emitted, p in outcomes.items():
        first[emitted[0]] += p
        if len(emitted) > 1:
            second[emitted[0], emitted[1]] += p
    gap = float((first - _target(ROOT_LOGITS, params)).abs().max())
    for token, logits in CHILD_LOGITS.items():
        if second[token].sum() > 0:
            conditional = second[token] / second[token].sum()
            gap = max(gap, float((conditional - _target(logits, params)).abs().max()))
    return gap


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed distribution in float64 (its fp32 probabilities sum to 1 only up to fp32 rounding)."""
    probs = processed_probs(logits, params).double()
    return probs / probs.sum()


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.7-top_p", "top_k"])
def test_enumeration_is_a_distribution_and_the_rule_is_exactly_lossless(params):
    outcomes = exact_outputs(params)
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-9)
    assert len(outcomes) >= 5 and any(len(e) == 3 for e in outcomes)  # depth-2 paths were accepted too
    assert lossless_error(outcomes, params) < 1e-9


def _choices_at_parent(original):
    """The target's choice after a node drawn from its parent's distribution (an off-by-one in reading logits)."""
    def choices(logits, params, uniforms):
        shifted = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return original(shifted, params, uniforms)
    return choices


def _inverse_cdf_off_by_one(original):
    def sample(probs, uniforms):
        return (original(probs, uniforms) + 1).clamp(max=probs.shape[-1] - 1)
    return sample


BROKEN = {
    "the choice after a node read from its parent's logits": ("target_choices", _choices_at_parent),
    "an off-by-one in the inverse CDF": ("_sample", _inverse_cdf_off_by_one),
}


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_each_plausible_bug_fails_the_exact_check(monkeypatch, bug):
    name, breaking = BROKEN[bug]
    monkeypatch.setattr(verify, name, breaking(getattr(verify, name)))
    assert lossless_error(exact_outputs(PARAMS[0]), PARAMS[0]) > 1e-2


def _splitmix64_reference(z: int) -> int:
    """splitmix64 as published, in Python's unbounded integers reduced modulo 2**64."""
    mask = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_uniforms_are_splitmix64_of_the_seed_and_position():
    """The int64 arithmetic wraps as the unsigned original on this machine (a platform where it did not would
    draw other tokens, and fail here)."""
    seeds, positions = [0, 1, 7, 2**40 + 3, -5], [0, 1, 2, 1000, 2**31 + 11]
    got = position_uniforms(torch.tensor(seeds), torch.tensor([positions] * len(seeds)))
    mask = (1 << 64) - 1
    for b, seed in enumerate(seeds):
        key = _splitmix64_reference(seed & mask)
        for i, position in enumerate(positions):
            z = _splitmix64_reference((key + position * 0x9E3779B97F4A7C15) & mask)
            assert float(got[b, i]) == (z >> 11) * 2.0**-53


def test_uniforms_are_uniform_and_independent_across_positions_and_seeds():
    u = position_uniforms(torch.arange(64), torch.arange(2000).expand(64, -1))
    flat = u.flatten().numpy()
    assert 0.0 <= flat.min() and flat.max() < 1.0
    assert stats.kstest(flat, "uniform").pvalue > 1e-3
    neighbours = float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1])
    seeds = float(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1])
    assert abs(neighbours) < 0.01 and abs(seeds) < 0.01  # 128k pairs: |r| ~ 0.003 by chance
