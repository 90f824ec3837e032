"""The per-sequence cost model (taps_ray.engine.cost): pause drafting when it does not pay, probe, resume, lossless."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import new_head
from taps_ray.engine.cost import MIN_PAUSE, CostAware
from taps_ray.engine.generate import NOT_DRAFTED, generate
from taps_ray.engine.registry import build_proposer, heads_used
from taps_ray.engine.tree import DraftTree, build_tree
from taps_ray.engine.verify import SamplingParams

from oracles import GreedyOracle

DRAFT_S, PLAIN_STEP_S, TREE_STEP_S = 0.2, 1.0, 1.2  # the fake machine: a drafted step costs 1.4 s, a plain one 1 s


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ChainDrafter:
    """Drafts a 3-token chain in DRAFT_S fake seconds; remembers every token it was handed."""

    clock: FakeClock
    name: str = "chain"
    head_names: list[str] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)

    def init_state(self) -> None:
        return None

    def propose(self, state: None, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, None]:
        assert features.shape[0] == next_tokens.shape[0]
        self.seen += next_tokens.tolist()
        self.clock.now += DRAFT_S
        return build_tree(torch.tensor([int(next_tokens[-1]), 1, 2, 3]), torch.tensor([-1, 0, 1, 2])), None


def test_pauses_while_acceptance_is_low_and_resumes_when_it_rises():
    clock = FakeClock()
    inner = ChainDrafter(clock)
    proposer = CostAware(inner, clock=clock)
    assert proposer.name == "auto-chain"
    tree, state = proposer.propose(proposer.init_state(), torch.zeros(5, 1), torch.arange(5))
    handed, drafted, heads = list(range(5)), [], []
    for step in range(120):
        accepted = 0 if step < 40 else 3  # 1.4 s per token while nothing is accepted, 0.35 s once 3 are
        drafted.append(tree.size > 1)
        heads.append(state.last_head)
        clock.now += TREE_STEP_S if tree.size > 1 else PLAIN_STEP_S
        committed = list(range(100 + step, 101 + step + (accepted if tree.size > 1 else 0)))
        handed += committed
        tree, state = proposer.propose(state, torch.zeros(len(committed), 1), torch.tensor(committed))
    assert drafted[:2] == [False, True]  # a plain baseline step first, then drafting
    assert drafted[2 : 2 + MIN_PAUSE] == [False] * MIN_PAUSE  # the first losing step starts a pause
    assert sum(drafted[2:40]) <= 3  # only probes while drafting loses, the pause doubling after each
    assert all(drafted[-40:])  # acceptance rose: the next probe paid and drafting resumed for good
    assert {h for h, d in zip(heads, drafted) if not d} == {NOT_DRAFTED}
    assert inner.seen == handed and not state.pending  # every committed token reached the drafter


def test_keeps_drafting_while_it_pays():
    clock = FakeClock()
    proposer = CostAware(ChainDrafter(clock), clock=clock)
    tree, state = proposer.propose(proposer.init_state(), torch.zeros(3, 1), torch.arange(3))
    drafted = []
    for step in range(20):
        drafted.append(tree.size > 1)
        clock.now += TREE_STEP_S if tree.size > 1 else PLAIN_STEP_S
        n = 3 if tree.size > 1 else 1
        tree, state = proposer.propose(state, torch.zeros(n, 1), torch.arange(n))
    assert drafted == [False] + [True] * 19 and state.pause == 0


def test_auto_proposers_are_lossless_with_accepting_drafts(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompt = [bos] + tok.encode("math: 12*7=")
    want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    oracle = CostAware(GreedyOracle(model, first_token=bos, depth=3))
    generation = generate(model, oracle, [prompt], SamplingParams(), 16, [])[0]
    assert generation.tokens == want.tolist() and max(s.accepted for s in generation.steps) > 0
    heads = {"math": new_head(model.config, seed=1), "chat": new_head(model.config, seed=2)}
    proposer = build_proposer("auto-math+ngram", tiny_target, heads, TreeConfig(total_token=8, depth=3, top_k=3))
    assert proposer.name == "auto-math+ngram" and proposer.head_names == ["math"]
    assert heads_used("auto-math+ngram", ["math", "chat"]) == ["math"]
    assert generate(model, proposer, [prompt], SamplingParams(), 16, [])[0].tokens == want.tolist()
