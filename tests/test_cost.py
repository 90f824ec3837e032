"""The per-sequence cost model (taps_ray.drafting.cost): pause drafting when it does not pay, probe, resume, lossless."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import new_head
from taps_ray.drafting.cost import MIN_PAUSE, CostAware, TreeCost, best_size
from taps_ray.decoding.generate import generate
from taps_ray.drafting.proposer import NOT_DRAFTED, Feedback, Proposer
from taps_ray.drafting.registry import build_proposer, heads_used
from taps_ray.drafting.tree import DraftTree, build_tree
from taps_ray.decoding.verify import SamplingParams

from oracles import GreedyOracle

DRAFT_S, PLAIN_STEP_S, NODE_S = 0.2, 1.0, 0.1  # the fake machine: a draft, a root-only step, each verified node
CONFIDENCE = [0.9, 0.8, 0.7]  # the chain drafter's path confidences (E_3 = 2.4)


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ChainDrafter(Proposer):
    """Drafts a chain with the given path confidences in DRAFT_S fake seconds; remembers every token handed in."""

    clock: FakeClock
    confidence: list[float] = field(default_factory=lambda: list(CONFIDENCE))
    name: str = "chain"
    head_names: list[str] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)

    def init_state(self) -> None:
        return None

    def propose(self, state: None, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, None]:
        assert features.shape[0] == next_tokens.shape[0]
        self.seen += next_tokens.tolist()
        self.clock.now += DRAFT_S
        n = len(self.confidence)
        tokens = torch.tensor([int(next_tokens[-1]), *range(1, n + 1)])
        return build_tree(tokens, torch.arange(-1, n), confidence=torch.tensor(self.confidence)), None


def decode(proposer: CostAware, clock: FakeClock, accepted: Callable[[int], int], steps: int):
    """Runs the fake machine as a loop does: verifying a tree of k drafted nodes costs PLAIN_STEP_S + k·NODE_S and
    commits 1 + min(accepted(step), k) tokens, which the loop's `observe` reports. Returns the kept sizes, the
    recorded heads and everything handed in."""
    tree, state = proposer.propose(proposer.init_state(), torch.zeros(5, 1), torch.arange(5))
    handed, kept, heads = list(range(5)), [], []
    for step in range(steps):
        kept.append(tree.size - 1)
        heads.append(state.last_head)
        clock.now += PLAIN_STEP_S + NODE_S * (tree.size - 1)
        committed = list(range(100 + step, 101 + step + min(accepted(step), tree.size - 1)))
        handed += committed
        (state,) = proposer.observe([state], [Feedback(tree, list(range(len(committed))), committed)])
        tree, state = proposer.propose(state, torch.zeros(len(committed), 1), torch.tensor(committed))
    return kept, heads, handed, state


def test_pauses_while_acceptance_is_low_and_resumes_when_it_rises():
    clock = FakeClock()
    inner = ChainDrafter(clock)
    proposer = CostAware(inner, clock=clock)
    assert proposer.name == "auto-chain"
    kept, heads, handed, state = decode(proposer, clock, lambda step: 0 if step < 40 else 3, 120)
    drafted = [k > 0 for k in kept]
    assert drafted[:2] == [False, True]  # a plain baseline step first, then drafting (its confidences trusted)
    first_pause = drafted.index(False, 1)  # one miss or a few, as the confidences and κ's prior weigh
    assert 2 <= first_pause <= 4 and drafted[first_pause : first_pause + MIN_PAUSE] == [False] * MIN_PAUSE
    assert sum(drafted[first_pause:40]) <= 3  # only probes while drafting loses, the pause doubling after each
    assert all(drafted[-40:])  # acceptance rose: a probe paid and drafting resumed for good
    assert {h for h, d in zip(heads, drafted) if not d} == {NOT_DRAFTED}
    assert inner.seen == handed and not state.pending  # every committed token reached the drafter


def test_keeps_drafting_while_it_pays():
    clock = FakeClock()
    proposer = CostAware(ChainDrafter(clock), clock=clock)
    kept, _, _, state = decode(proposer, clock, lambda step: 3, 20)
    assert kept == [0] + [3] * 19 and state.pause == 0
    assert state.calibration > 1  # 3 accepted where 2.4 were promised


def test_verifies_only_the_nodes_that_pay_for_themselves():
    """Each node costs 0.1 of a plain step; confidences 0.9, 0.6, 0.01, 0.005: the last two are expected to add
    0.015 tokens for 0.2 steps of verification, so the tree shrinks to the first two (what best_size says)."""
    clock = FakeClock()
    proposer = CostAware(ChainDrafter(clock, confidence=[0.9, 0.6, 0.01, 0.005]), clock=clock)
    kept, _, _, state = decode(proposer, clock, lambda step: 2, 10)
    assert kept == [0] + [2] * 9
    assert abs(state.verify_cost(2) - (PLAIN_STEP_S + 2 * NODE_S)) < 1e-9  # the fit reproduces the steps it saw

    def linear(per_node: float) -> Callable[[int], float]:
        return lambda k: 1.0 + per_node * k

    assert best_size([0.9, 0.5, 0.02, 0.01], linear(0.1), calibration=1.0) == 2
    assert best_size([0.9, 0.5, 0.02, 0.01], linear(0.0), calibration=1.0) == 4  # free nodes: all
    assert best_size([0.9, 0.5], linear(0.1), calibration=0.05) == 0  # drafts that never land: none
    with_jump = lambda k: 1.0 + (0.5 + 0.01 * k if k else 0.0)  # any tree costs half a step more, nodes little
    assert best_size([0.9, 0.5, 0.2, 0.1], with_jump, calibration=1.0) == 4  # once the jump is paid, keep them
    assert best_size([0.3, 0.1], with_jump, calibration=1.0) == 0  # 0.4 tokens do not pay half a step


def test_tree_cost_fit_separates_the_jump_from_the_per_node_cost():
    cost = TreeCost()
    assert cost.fit(guess=0.02) == (0.0, 0.02)  # nothing measured: no jump, the guessed slope
    for kept in (2, 7, 4, 7, 3, 6, 5, 7):
        cost = cost.add(kept, 0.3 + 0.01 * kept)
    jump, per_node = cost.fit(guess=0.05)
    assert abs(per_node - 0.01) < 0.25 * abs(0.05 - 0.01)  # the sizes vary: the data outweighs the guess
    assert abs(jump - 0.3) < 0.04 and jump + 7 * per_node > 0.3 + 7 * 0.01 - 0.01
    one_size = TreeCost().add(7, 0.37).add(7, 0.37)
    jump, per_node = one_size.fit(guess=0.01)
    assert abs(per_node - 0.01) < 1e-12 and abs(jump + 7 * per_node - 0.37) < 1e-9  # one size: the slope is the guess


def test_a_tree_no_node_of_which_pays_is_verified_as_its_root_and_drafting_pauses():
    clock = FakeClock()
    inner = ChainDrafter(clock, confidence=[0.01, 0.005])
    proposer = CostAware(inner, clock=clock)
    kept, heads, handed, state = decode(proposer, clock, lambda step: 0, 40)
    assert kept == [0] * 40 and set(heads) == {NOT_DRAFTED}  # drafted, but not even a probe verifies such a tree
    assert len(inner.seen) > 5 and inner.seen == handed[: len(inner.seen)]  # the drafter ran, and saw every token
    assert state.pause >= 2 * MIN_PAUSE  # each drafted step lost, and the pause doubled


def test_probes_trust_the_confidences_so_a_sequence_can_recover():
    """After many misses κ is low enough to prune any tree to its root; the probe judges with κ = 1, so when the
    drafts start landing again the probe verifies them, κ recovers and drafting resumes."""
    clock = FakeClock()
    proposer = CostAware(ChainDrafter(clock), clock=clock)
    kept, _, _, state = decode(proposer, clock, lambda step: 0 if step < 60 else 3, 200)
    assert state.pause == 0 and all(k == 3 for k in kept[-40:])


def test_auto_proposers_are_lossless_with_accepting_drafts(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompt = [bos] + tok.encode("math: 12*7=")
    want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    ticks = itertools.count()  # every clock reading one second later: deterministic costs (drafting pays here)
    torch.manual_seed(0)  # the oracle's confidences are random: with some draws no tree pays and none is verified
    oracle = CostAware(GreedyOracle(model, first_token=bos, depth=3), clock=lambda: float(next(ticks)))
    generation = generate(model, oracle, [prompt], SamplingParams(), 16, [])[0]
    assert generation.tokens == want.tolist() and max(s.accepted for s in generation.steps) > 0
    heads = {"math": new_head(model.config, seed=1), "chat": new_head(model.config, seed=2)}
    proposer = build_proposer("auto-math+ngram", tiny_target, heads, TreeConfig(total_token=8, depth=3, top_k=3))
    assert proposer.name == "auto-math+ngram" and proposer.head_names == ["math"]
    assert heads_used("auto-math+ngram", ["math", "chat"]) == ["math"]
    assert generate(model, proposer, [prompt], SamplingParams(), 16, [])[0].tokens == want.tolist()


def test_the_inner_proposer_hears_what_was_accepted_of_its_own_trees():
    """A learning proposer (the learned router) keeps learning under the cost model: `observe` reaches it for the
    steps it drafted, not for the root-only ones (the plain baseline step, pauses)."""
    clock = FakeClock()

    @dataclass
    class Listening(ChainDrafter):
        heard: list[int] = field(default_factory=list)

        def observe(self, states, feedback):
            self.heard += [f.accepted for f in feedback]
            return states

    inner = Listening(clock)
    proposer = CostAware(inner, clock=clock)
    tree, state = proposer.propose(proposer.init_state(), torch.zeros(5, 1), torch.arange(5))
    for step in range(4):
        clock.now += PLAIN_STEP_S + NODE_S * (tree.size - 1)
        committed = [100 + step] if tree.size == 1 else [1, 2, 100 + step]  # two drafts accepted, then the bonus
        (state,) = proposer.observe([state], [Feedback(tree, list(range(len(committed))), committed)])
        tree, state = proposer.propose(state, torch.zeros(len(committed), 1), torch.tensor(committed))
    assert inner.heard == [2, 2, 2]  # the first step verified only its root: not the inner's tree


def test_the_drafting_sequences_of_a_batch_draft_in_one_call_of_the_wrapped_proposer():
    """Serve's batch shares one `CostAware`: its drafting sequences draft in one `propose_batch` of the wrapped
    proposer (one draft pass for the batch), its paused ones verify their roots, and every one is charged the
    batch's draft time (its step waits for all of it). One by one, 16 sequences cost 16 draft passes."""
    clock = FakeClock()

    @dataclass
    class Batched(ChainDrafter):
        calls: list[int] = field(default_factory=list)

        def propose_batch(self, states, features, next_tokens):
            self.calls.append(len(states))
            start = self.clock.now
            out = [self.propose(s, f, t) for s, f, t in zip(states, features, next_tokens)]
            self.clock.now = start + DRAFT_S  # one pass, whatever the batch
            return [tree for tree, _ in out], [state for _, state in out]

    inner = Batched(clock)
    proposer = CostAware(inner, clock=clock)
    trees, states = proposer.propose_batch([proposer.init_state() for _ in range(3)], [torch.zeros(2, 1)] * 3,
                                           [torch.tensor([7, 8])] * 3)
    assert inner.calls == [] and [t.size for t in trees] == [1, 1, 1]  # the first step of each: plain, measured
    clock.now += PLAIN_STEP_S
    states = proposer.observe(states, [Feedback(tree, [0], [9]) for tree in trees])
    states[2] = replace(states[2], paused_left=2)  # the third sequence is in a pause
    start = clock.now
    trees, states = proposer.propose_batch(states, [torch.zeros(1, 1)] * 3, [torch.tensor([9])] * 3)
    assert inner.calls == [2]  # the two drafting sequences, in one call
    assert [t.size for t in trees] == [4, 4, 1] and [s.last_head for s in states] == [0, 0, NOT_DRAFTED]
    assert [s.draft_s for s in states] == [pytest.approx(DRAFT_S)] * 2 + [None]
    assert clock.now == pytest.approx(start + DRAFT_S)
    assert states[2].paused_left == 1 and len(states[2].pending) == 2  # the pause counts down; nothing is lost
    assert inner.seen == [7, 8, 9] * 2  # each drafting sequence handed its whole backlog, the prompt on
