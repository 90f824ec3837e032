"""Prompt-lookup drafting (taps_ray.drafting.ngram) and its heterogeneous merge with heads (`<proposer>+ngram`)."""

from __future__ import annotations

import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import new_head
from taps_ray.drafting.combine import rank_merge
from taps_ray.decoding.continuous import ContinuousBatcher, Request
from taps_ray.decoding.generate import generate
from taps_ray.drafting.names import ProposerSpec, parse_proposer
from taps_ray.drafting.ngram import NgramProposer, NgramState, lookup, matched_prefix
from taps_ray.drafting.registry import UnknownProposer, build_proposer, heads_used, proposer_names
from taps_ray.drafting.tree import build_tree
from taps_ray.decoding.verify import SamplingParams

GREEDY = SamplingParams()
TREE = TreeConfig(total_token=8, depth=3, top_k=3)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def heads(tiny_target):
    config = tiny_target.model.config
    return {"math": new_head(config, seed=1), "chat": new_head(config, seed=2)}


@pytest.fixture(scope="module")
def repetitive(tiny_target) -> tuple[list[int], list[int]]:
    """A prompt that repeats itself, and the target's greedy continuation (random targets loop, too)."""
    tok = tiny_target.tokenizer
    prompt = tok.encode("one two three four five one two three four five one two three")
    return prompt, _hf_greedy(tiny_target.model, prompt, 24)


def test_lookup_takes_the_longest_ngram_and_its_latest_occurrence():
    assert lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], max_ngram=3, num_tokens=2) == [9, 2]  # "1 2 3" beats "2 3 7"
    assert lookup([5, 2, 3, 7, 8, 2, 3, 4, 6, 3], max_ngram=3, num_tokens=3) == [4, 6, 3]  # 1-gram "3", latest
    assert lookup([1, 2, 1], max_ngram=3, num_tokens=5) == [2, 1]  # the continuation stops at the text's end
    assert lookup([1, 2, 3], max_ngram=3, num_tokens=5) == [] and lookup([4], 3, 5) == []


def test_matched_prefix_counts_conditional_tries():
    assert matched_prefix([5, 6, 7], [5, 6, 9, 1]) == (2, 3)  # third token compared and missed
    assert matched_prefix([5, 6, 7], [5, 6]) == (2, 2)  # third token never compared
    assert matched_prefix([], [1]) == (0, 0)


def test_ngram_chain_confidence_follows_the_running_hit_rate():
    proposer = NgramProposer(max_ngram=2, num_tokens=3)
    tree, state = proposer.propose(proposer.init_state(), torch.zeros(6, 1), torch.tensor([1, 2, 3, 4, 1, 2]))
    assert tree.tokens.tolist() == [2, 3, 4, 1] and tree.is_chain and state.rate == 0.5
    assert torch.allclose(tree.confidence, torch.tensor([0.5, 0.25, 0.125])) and not tree.entropy.any()
    _, state = proposer.propose(state, torch.zeros(3, 1), torch.tensor([3, 4, 8]))  # 2 hits, 1 miss
    assert (state.hits, state.tries) == (2, 3) and state.rate == pytest.approx(3 / 5)
    tree, _ = proposer.propose(NgramState(), torch.zeros(2, 1), torch.tensor([7, 8]))
    assert tree.size == 1  # nothing to look up: the root alone (plain decoding for this step)


def test_ngram_alone_is_lossless_and_accepts(tiny_target, repetitive):
    prompt, want = repetitive
    generation = generate(tiny_target.model, NgramProposer(), [prompt], GREEDY, 24, [])[0]
    assert generation.tokens == want
    assert sum(s.accepted for s in generation.steps) > 0 and len(generation.steps) < 24


def test_ngram_replays_like_the_live_loop_with_the_registry_reach(tiny_target, repetitive):
    """A prompt-lookup chain can reach deeper below its root than an EAGLE tree (depth + 1): replay must record
    `draft_reach` tokens past an answer's end, and traces recorded that far replay the live loop step for step."""
    from taps_ray.decoding.replay import record_traces, replay
    from taps_ray.decoding.target_batch import TargetBatch
    from taps_ray.drafting.registry import draft_reach

    history = torch.arange(100, 112)  # twelve distinct tokens, then the first three again: a 3-gram match
    chain, _ = NgramProposer().propose(NgramState(), torch.zeros(15, 1), torch.cat([history, history[:3]]))
    assert int(chain.depth.max()) + 1 > TREE.depth + 1  # deeper than the tree settings alone allow for
    assert int(chain.depth.max()) + 1 <= draft_reach(TREE)

    prompt, _ = repetitive
    live = generate(tiny_target.model, NgramProposer(), [prompt], GREEDY, 24, [])[0]
    traces = record_traces(lambda: TargetBatch(tiny_target.model), [prompt], 24, [], draft_reach(TREE))
    replayed = replay(NgramProposer(), traces, 24, [])[0]
    assert replayed.tokens == live.tokens
    assert [(s.accepted, s.new_tokens) for s in replayed.steps] == [(s.accepted, s.new_tokens) for s in live.steps]
    assert sum(s.accepted for s in replayed.steps) > 0


def test_head_plus_ngram_is_lossless_accepts_and_keeps_the_budget(tiny_target, heads, repetitive):
    prompt, want = repetitive
    other = tiny_target.tokenizer.encode("2+2=")
    proposer = build_proposer("math+ngram", tiny_target, heads, TREE)
    assert proposer.head_names == ["math"]
    together = generate(tiny_target.model, proposer, [prompt, other], GREEDY, 24, [])
    assert together[0].tokens == want and together[1].tokens == _hf_greedy(tiny_target.model, other, 24)
    steps = together[0].steps
    assert all(s.tree_size <= TREE.total_token and s.head == -1 for s in steps)
    ngram_accepted = sum(a and src == 1 for s in steps for a, src in zip(s.node_accepted, s.node_source))
    assert ngram_accepted > 0  # the n-gram nodes carried accepted tokens


def test_rank_merge_ranks_across_sources_and_shares_prefixes():
    head = build_tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]), confidence=torch.tensor([0.9, 0.3, 0.05]))
    chain = build_tree(torch.tensor([9, 1, 4, 5]), torch.tensor([-1, 0, 1, 2]), confidence=torch.tensor([0.8, 0.64, 0.51]))
    tree, added = rank_merge([head, chain], budget=3)
    # 0.9 (head 1) | 0.8 (chain 1 = head 1: shared) | 0.64 (chain 4) | 0.51 (chain 5): budget reached
    assert tree.tokens.tolist() == [9, 1, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert added == (1, 2) and tree.source.tolist() == [0, 1, 1]
    tree, added = rank_merge([head, chain], budget=10)
    assert tree.size - 1 == 5 and added == (3, 2)  # every distinct node, the shared one once


def test_names_and_heads_used(tiny_config, tiny_target, heads):
    names = proposer_names(tiny_config)
    assert "ngram" in names and f"{tiny_config.train.mixtures[0]}+ngram" in names
    assert heads_used("ngram", ["math", "chat"]) == [] and heads_used("chat+ngram", ["math", "chat"]) == ["chat"]
    assert heads_used("merged+ngram", ["math", "chat"]) == ["math", "chat"]
    merged = build_proposer("merged+ngram", tiny_target, heads, TREE)
    assert merged.head_names == ["math", "chat"] and merged.name == "merged+ngram"
    for bad in ("plain+ngram", "ngram+ngram", "nothing+ngram"):
        with pytest.raises(UnknownProposer, match="unknown proposer"):
            build_proposer(bad, tiny_target, heads, TREE)


def test_a_name_parses_into_one_spec():
    """`[auto-]<base>[+ngram]`, parsed once: the registry, the set-up and Serve read the same fields."""
    assert parse_proposer("auto-merged+ngram") == ProposerSpec("merged", ngram=True, auto=True)
    assert parse_proposer("averaged-w0.3+ngram") == ProposerSpec("averaged-w0.3", weight=0.3, ngram=True)
    assert parse_proposer("averaged") == ProposerSpec("averaged", weight=0.5)
    assert parse_proposer("auto-ngram") == ProposerSpec("ngram", auto=True)
    assert parse_proposer("plain+ngram") == ProposerSpec("plain+ngram")  # nothing to merge with: an unknown base
    assert parse_proposer("auto-routed+ngram") == ProposerSpec("confidence-routed", ngram=True, auto=True)  # an alias
    for name in ("auto-merged+ngram", "math", "auto-plain", "averaged-w0.3+ngram", "plain+ngram"):
        assert parse_proposer(name).name == name
    assert parse_proposer("math+ngram").drafts_with_heads and not parse_proposer("auto-ngram").drafts_with_heads
    with pytest.raises(UnknownProposer, match="averaged-w"):
        parse_proposer("auto-averaged-w2")


def test_continuous_batching_keeps_each_sequence_its_ngram_state(tiny_target, heads, repetitive):
    prompt, want = repetitive
    other = tiny_target.tokenizer.encode("hello world")
    batcher = ContinuousBatcher(tiny_target.model, stop_ids=[], max_batch_size=4)
    results: dict = {}
    proposers = [NgramProposer(), build_proposer("math+ngram", tiny_target, heads, TREE)]
    for i, (p, proposer) in enumerate([(prompt, proposers[0]), (other, proposers[0]), (prompt, proposers[1])]):
        batcher.submit(Request(p, proposer, GREEDY, 24, seed=0), on_done=lambda r, i=i: results.__setitem__(i, r))
    while batcher.busy:
        batcher.step()
    assert results[0].generation.tokens == want and results[2].generation.tokens == want
    assert results[1].generation.tokens == _hf_greedy(tiny_target.model, other, 24)
    assert sum(s.accepted for s in results[0].generation.steps) > 0
