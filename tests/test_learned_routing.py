"""`learned-routed`: Hedge over the heads, fed by merged steps' acceptance; lossless at T = 0 and T > 0."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

from taps_ray.config import TreeConfig
from taps_ray.decoding.generate import generate
from taps_ray.decoding.verify import SamplingParams, processed_probs
from taps_ray.drafting.combine import merge_trees
from taps_ray.drafting.learned import MERGED, LearnedRouted, held_per_source, held_per_sources
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.eagle2 import DraftContext
from taps_ray.drafting.registry import build_proposer
from taps_ray.drafting.tree import build_tree
from taps_ray.models.draft_head import new_head

from oracles import FixedTree, GreedyOracle

GREEDY = SamplingParams()


def _tree(tokens: list[int], parents: list[int]):
    return build_tree(torch.tensor(tokens), torch.tensor(parents))


def test_held_per_source_counts_each_heads_own_match():
    a = _tree([9, 1, 2, 3], [-1, 0, 1, 2])  # chain 1 2 3
    b = _tree([9, 1, 5, 2], [-1, 0, 1, 0])  # 1 -> 5, and 2 beside it
    merged = merge_trees([a, b])
    assert held_per_source(merged, [1, 2, 7], 2) == [2, 1]  # a holds "1 2", b only "1"
    assert held_per_source(merged, [2, 4], 2) == [0, 1]
    assert held_per_source(merged, [8], 2) == [0, 0]


def test_held_per_sources_reads_a_batch_as_each_tree_alone():
    """The batch's merged trees read in one go give each tree's own counts (trees of different sizes)."""
    a = _tree([9, 1, 2, 3], [-1, 0, 1, 2])
    b = _tree([9, 1, 5, 2], [-1, 0, 1, 0])
    c = _tree([9, 2, 4], [-1, 0, 1])
    trees = [merge_trees([a, b]), merge_trees([c, a]), merge_trees([b, c], dedup=True)]
    committed = [[1, 2, 7], [2, 4, 1], [2, 4]]
    assert held_per_sources(trees, committed, 2) == [held_per_source(t, k, 2) for t, k in zip(trees, committed)]
    assert held_per_sources(trees, committed, 2)[1] == [2, 0]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_learns_the_accepting_head_and_stays_lossless(tiny_target, prompts):
    """An oracle that drafts the target's greedy chain beside a tree the target never accepts: after its merged
    warm-up the router drafts with the oracle alone, re-checks with a merged step every `period` steps, and the
    output is the target's greedy output, drafts accepted."""
    model = tiny_target.model
    prompt = prompts[0]
    oracle = GreedyOracle(model, first_token=prompt[0], depth=3)
    vocab = model.config.vocab_size
    junk = FixedTree(tokens=[vocab - 1, vocab - 2], parents=[0, 1])
    for parts, leader in (([junk, oracle], 1), ([oracle, junk], 0)):
        router = LearnedRouted(parts, warmup=2, period=6)
        generation = generate(model, router, [prompt], GREEDY, 24, [])[0]
        assert generation.tokens == _hf_greedy(model, prompt, 24)
        heads = [s.head for s in generation.steps]
        assert heads[:2] == [MERGED, MERGED]
        assert set(heads) == {leader, MERGED}  # the junk tree never drafts alone
        exploit = [s for s in generation.steps if s.head == leader]
        assert sum(s.accepted for s in exploit) > 0  # drafts accepted while the learned leader drafted alone
        assert all(s.tree_size < 2 + 3 * 2 + 2 for s in exploit)  # one tree verified, not the merged pair
        # the re-check: no run of leader steps longer than the period allows
        runs = [len(list(g)) for h, g in itertools.groupby(heads) if h == leader]
        assert max(runs) <= router.period - 1


def test_idle_head_reads_what_it_missed(tiny_target, prompts):
    """A head that sat steps out is handed every committed position it missed when it drafts again."""
    from oracles import Recording

    model = tiny_target.model
    prompt = prompts[0]
    oracle = GreedyOracle(model, first_token=prompt[0], depth=3)
    vocab = model.config.vocab_size
    idle = Recording(FixedTree(tokens=[vocab - 1], parents=[0]))
    router = LearnedRouted([oracle, idle], warmup=1, period=4)
    generation = generate(model, router, [prompt], GREEDY, 20, [])[0]
    assert any(s.head == 0 for s in generation.steps)  # the idle head did sit steps out
    seen = idle.seen[0]
    assert seen == prompt[1:] + generation.tokens[: len(seen) - len(prompt) + 1]


def test_registry_builds_it_over_the_first_two_heads(tiny_target, prompts):
    config = tiny_target.model.config
    heads = {"math": new_head(config, seed=1), "chat": new_head(config, seed=2), "mixed": new_head(config, seed=3)}
    router = build_proposer("learned-routed", tiny_target, heads, TreeConfig(total_token=8, depth=3, top_k=3))
    assert isinstance(router, LearnedRouted) and router.head_names == ["math", "chat"]
    generation = generate(tiny_target.model, router, prompts[1:], GREEDY, 6, [])[0]
    assert generation.tokens == _hf_greedy(tiny_target.model, prompts[1], 6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sampling_through_the_loop_is_lossless(small_vocab_target, params):
    """The first three tokens of many seeded runs follow the target's own distribution, though which tree the
    router verifies at the second and third step depends on what the first steps accepted."""
    model = small_vocab_target.model
    config = model.config
    tree = TreeConfig(total_token=5, depth=2, top_k=2)
    context = DraftContext(model.get_input_embeddings(), model.lm_head)
    heads = [SingleHead("a", new_head(config, seed=1), context, tree),
             SingleHead("b", new_head(config, seed=2), context, tree)]
    with torch.no_grad():
        heads[0].head.fc.weight.mul_(5.0)
    router = LearnedRouted(heads, warmup=1, sure=0.0)  # exploit from the second step: routing follows acceptance
    prompt, runs, vocab = [1, 2, 3], 2000, config.vocab_size
    generations = generate(model, router, [prompt] * runs, params, 3, [], seeds=list(range(runs)))
    assert sum(s.accepted for g in generations for s in g.steps) > 0
    assert any(s.head >= 0 for g in generations for s in g.steps[1:])  # single-head steps chosen by acceptance
    counts = torch.zeros(vocab**3)
    for g in generations:
        x1, x2, x3 = g.tokens[:3]
        counts[(x1 * vocab + x2) * vocab + x3] += 1
    with torch.no_grad():
        exact = torch.zeros(vocab**3)
        p1 = processed_probs(model(torch.tensor([prompt])).logits[0, -1], params)
        for x1, x2 in itertools.product(range(vocab), repeat=2):
            p2 = processed_probs(model(torch.tensor([prompt + [x1]])).logits[0, -1], params)
            p3 = processed_probs(model(torch.tensor([prompt + [x1, x2]])).logits[0, -1], params)
            exact[(x1 * vocab + x2) * vocab: (x1 * vocab + x2 + 1) * vocab] = p1[x1] * p2[x2] * p3
    keep = exact * runs > 0
    assert counts[~keep].sum() == 0
    expected = exact[keep] * runs
    big = expected >= 5  # chi-square cells with enough expectation; the rest pooled into one
    observed = torch.cat([counts[keep][big], counts[keep][~big].sum().unsqueeze(0)])
    pooled = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    assert stats.chisquare(observed, pooled * observed.sum() / pooled.sum()).pvalue > 1e-3
