"""The T > 0 acceptance rule, checked exactly: every random choice of `accept_stochastic` is enumerated with its
probability, so the output distribution is computed, not sampled, and a broken rule fails every time."""

from __future__ import annotations

import pytest
import torch

import taps_ray.decoding.verify as verify
from taps_ray.decoding.verify import SamplingParams, accept_stochastic, processed_probs
from taps_ray.drafting.tree import build_tree

V = 4
PARAMS = SamplingParams(temperature=1.0)
# Root 0; first level 3, 1, 3 (a duplicate, as merged trees have), 2; under node 1 (3): 1, 0; under node 2 (1): 3.
TREE = build_tree(torch.tensor([0, 3, 1, 3, 2, 1, 0, 3]), torch.tensor([-1, 0, 0, 0, 0, 1, 1, 2]))
ROOT_LOGITS = torch.tensor([0.3, 1.1, -0.4, 0.8])
CHILD_LOGITS = {3: torch.tensor([0.9, -0.2, 0.5, 0.1]), 1: torch.tensor([-0.7, 0.4, 1.3, 0.0]),
                2: torch.tensor([0.2, 0.2, -1.0, 0.6])}


def _logits() -> torch.Tensor:
    """Per-node target logits; a node's logits depend on its path only (the duplicate 3 shares node 1's)."""
    rows = [ROOT_LOGITS]
    for node in range(1, TREE.size):
        token, depth = int(TREE.tokens[node]), int(TREE.depth[node])
        rows.append(CHILD_LOGITS[token] if depth == 1 else torch.tensor([0.1 * node, -0.3, 0.2, 0.05 * node]))
    return torch.stack(rows)


def exact_outputs(monkeypatch, acceptance=lambda p: p) -> dict[tuple[int, ...], float]:
    """P(emitted tokens) of one `accept_stochastic` call: depth-first over every coin and draw it makes.
    `acceptance` maps the probability the rule asks a coin for to the one it gets (identity: the rule as is)."""
    outcomes: dict[tuple[int, ...], float] = {}
    scripts: list[list] = [[]]
    while scripts:
        script, made, weight = scripts.pop(), [], [1.0]

        def choose(options: list[tuple[object, float]]):
            options = [(value, p) for value, p in options if p > 0]
            if len(made) < len(script):
                value = script[len(made)]
            else:
                value = options[0][0]
                scripts.extend(made + [other] for other, _ in options[1:])
            made.append(value)
            weight[0] *= dict(options)[value]
            return value

        monkeypatch.setattr(verify, "_coin", lambda p, g: choose([(True, acceptance(p)), (False, 1.0 - acceptance(p))]))
        monkeypatch.setattr(verify, "_draw", lambda probs, g: choose(
            [(t, float(probs[t] / probs.sum())) for t in range(probs.numel())]))
        verdict = accept_stochastic(TREE, _logits(), PARAMS, torch.Generator())
        emitted = tuple(verdict.tokens[1:] + [verdict.bonus])
        outcomes[emitted] = outcomes.get(emitted, 0.0) + weight[0]
    return outcomes


def lossless_error(outcomes: dict[tuple[int, ...], float]) -> float:
    """Largest gap between the enumerated distributions and the target's: of the first emitted token, and of the
    second given an accepted first token (its node's distribution)."""
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, V, dtype=torch.float64)
    for emitted, p in outcomes.items():
        first[emitted[0]] += p
        if len(emitted) > 1:
            second[emitted[0], emitted[1]] += p
    gap = float((first - processed_probs(ROOT_LOGITS, PARAMS).double()).abs().max())
    for token, logits in CHILD_LOGITS.items():
        if second[token].sum() > 0:
            conditional = second[token] / second[token].sum()
            gap = max(gap, float((conditional - processed_probs(logits, PARAMS).double()).abs().max()))
    return gap


def test_enumeration_is_a_distribution_and_the_rule_is_exactly_lossless(monkeypatch):
    outcomes = exact_outputs(monkeypatch)
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-6)  # fp32 probabilities
    assert len(outcomes) > 10 and any(len(e) == 3 for e in outcomes)  # depth-2 paths were accepted too
    assert lossless_error(outcomes) < 1e-6


def _no_renormalisation(probs: torch.Tensor, token: int) -> torch.Tensor:
    probs = probs.clone()
    probs[token] = 0.0
    return probs


def _mass_kept(probs: torch.Tensor, token: int) -> torch.Tensor:
    return probs / probs.sum()


BROKEN = {
    "missing renormalisation after a rejection": ("_remove", _no_renormalisation),
    "the rejected token's mass is not removed": ("_remove", _mass_kept),
}


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_each_plausible_bug_fails_the_exact_check(monkeypatch, bug):
    name, patched = BROKEN[bug]
    monkeypatch.setattr(verify, name, patched)
    assert lossless_error(exact_outputs(monkeypatch)) > 1e-2


def test_accepting_by_the_draft_probability_fails_the_exact_check(monkeypatch):
    """The draft is a point mass (q = 1), so the target/draft ratio is p(x); accepting with the draft's
    probability q(x) = 1 instead takes every first candidate."""
    assert lossless_error(exact_outputs(monkeypatch, acceptance=lambda p: 1.0)) > 1e-2
