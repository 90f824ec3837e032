"""Routers and merged trees draft their heads side by side (one batched forward per tree level) and get the
trees the heads draft one by one; parts that do not stack fall back to drafting one after the other."""

from __future__ import annotations

import math

import pytest
import torch

from taps_ray.config import TreeConfig
from taps_ray.decoding.generate import generate
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.combine import ConfidenceRouted, Merged, merge_trees
from taps_ray.drafting.ngram import NgramProposer
from taps_ray.drafting.proposers import Recording, SingleHead
from taps_ray.drafting.registry import build_proposer
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, draft_eagle2, extend_batch
from taps_ray.drafting.tree import DraftTree
from taps_ray.models.draft_head import new_head
from taps_ray.models.stacked_head import StackedHead, stack_mismatch

from numerics import assert_same_tree, rounding_rtol, tree_rtol
from oracles import fit_head

GREEDY = SamplingParams()
TREE = TreeConfig(total_token=8, depth=3, top_k=3)
MAX_NEW = 12


@pytest.fixture(scope="module")
def expected(tiny_target, prompts) -> list[list[int]]:
    """The target's own greedy continuations (the loop's, so stop tokens end them alike)."""
    plain = build_proposer("plain", tiny_target, {}, TREE)
    return [g.tokens for g in generate(tiny_target.model, plain, prompts, GREEDY, MAX_NEW, tiny_target.stop_token_ids)]


@pytest.fixture(scope="module")
def fitted(tiny_target, prompts, expected):
    """Two heads fitted to the target's continuations (different data, so their trees differ): drafts get accepted."""
    sequences = [p + e for p, e in zip(prompts, expected)]
    return {"math": fit_head(tiny_target, sequences, steps=60), "chat": fit_head(tiny_target, sequences[1:], seed=1,
                                                                                 steps=60)}


def _assert_same_tree(got: DraftTree, want: DraftTree, hidden_size: int) -> bool:
    """A stacked head's tree is the head's own up to rounding: `bmm` over the stack and one head's `mm` run
    different kernels, which round alike on some CPUs and not on others (tests/numerics.py)."""
    return assert_same_tree(got, want, tree_rtol(hidden_size, TREE.depth))


def test_stacked_head_rows_run_each_head(tiny_target):
    config = tiny_target.model.config
    heads = [new_head(config, seed=1, trained_on="a"), new_head(config, seed=2, trained_on="b")]
    stack = StackedHead(heads)
    assert stack.stacked == 2 and not any(p.is_meta for p in stack.parameters())
    torch.manual_seed(0)
    d, t = config.hidden_size, 5
    emb, features = torch.randn(2, t, d), torch.randn(2, t, d)
    positions, mask = torch.arange(t)[None], torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out, _ = stack(emb, features, positions, mask)
        for n, head in enumerate(heads):
            alone, _ = head(emb[n : n + 1], features[n : n + 1], positions, mask)
            rtol = rounding_rtol(d, chained=4)  # fc, attention, MLP: reductions over the hidden size
            torch.testing.assert_close(out[n : n + 1], alone, rtol=rtol, atol=rtol)


def test_stack_mismatch_names_why(tiny_target):
    config = tiny_target.model.config
    head = new_head(config, seed=1)
    assert stack_mismatch([head, new_head(config, seed=2, trained_on="other data")]) is None
    assert "configurations differ" in stack_mismatch([head, new_head(config, seed=2, fc_bias=True)])
    assert "EAGLE-3" in stack_mismatch([new_head(config, kind="eagle3"), new_head(config, kind="eagle3", seed=2)])
    assert "dtypes" in stack_mismatch([head, new_head(config, seed=2, dtype=torch.bfloat16)])
    assert "at least two" in stack_mismatch([head])
    with pytest.raises(ValueError, match="cannot stack"):
        StackedHead([head, new_head(config, seed=2, fc_bias=True)])


@pytest.mark.parametrize("name", ["confidence-routed", "merged"])
def test_batched_trees_equal_per_head_trees_along_a_decode(tiny_target, fitted, prompts, name):
    """Every step of a real decode (drafts accepted, so several positions commit at once): the side-by-side
    trees are the trees each head drafts alone from its own cache (up to rounding and rare near-ties), and the
    router's output follows from them."""
    proposer = build_proposer(name, tiny_target, fitted, TREE)
    assert proposer.side_by_side is not None
    d = tiny_target.model.config.hidden_size
    rtol = tree_rtol(d, TREE.depth)
    for prompt in prompts:
        recorder = Recording(proposer)
        generation = generate(tiny_target.model, recorder, [prompt], GREEDY, MAX_NEW, tiny_target.stop_token_ids)[0]
        assert len(recorder.calls) >= 3 and any(s.accepted for s in generation.steps)
        alone = [(part, HeadCache()) for part in proposer.parts]
        batched = proposer.init_state()
        near_ties = 0
        for features, next_tokens, tree, state in recorder.calls:
            singles = []
            for i, (part, cache) in enumerate(alone):
                single, cache = part.propose(cache, features, next_tokens)
                alone[i] = (part, cache)
                singles.append(single)
            (side_by_side,), (batched,) = proposer.draft_all([batched], [features], [next_tokens])
            tied = [_assert_same_tree(got, want, d) for got, want in zip(side_by_side, singles)]
            near_ties += any(tied)
            assert state.stacked.length == alone[0][1].length and state.parts == ()
            if any(tied):
                continue  # the parts' trees differ at a near-tie: so may everything derived from them
            assert state.confidences == pytest.approx([t.mean_confidence for t in singles], rel=rtol)
            assert state.entropies == pytest.approx([t.mean_entropy for t in singles], rel=rtol)
            if name == "merged":
                assert state.last_head == -1
                _assert_same_tree(tree, merge_trees(singles), d)
            else:
                means = [t.mean_confidence for t in singles]
                if math.isclose(*means, rel_tol=rtol):
                    continue  # the heads tie on confidence: either choice is the router's
                best = max(range(2), key=lambda i: (means[i], -i))
                assert state.last_head == best
                _assert_same_tree(tree, singles[best], d)
        assert near_ties <= len(recorder.calls) // 4, f"{near_ties} near-ties in {len(recorder.calls)} steps"


@pytest.mark.parametrize("name", ["confidence-routed", "merged", "merged-dedup", "merged-budget"])
def test_batched_drafting_is_lossless_greedy_and_accepts_drafts(tiny_target, fitted, prompts, expected, name):
    proposer = build_proposer(name, tiny_target, fitted, TREE)
    assert proposer.side_by_side is not None
    generations = generate(tiny_target.model, proposer, prompts, GREEDY, MAX_NEW, tiny_target.stop_token_ids)
    assert [g.tokens for g in generations] == expected
    assert sum(s.accepted for g in generations for s in g.steps) > 0
    assert sum(len(g.steps) for g in generations) < sum(len(e) for e in expected)  # fewer steps than tokens


def test_parts_that_do_not_stack_draft_one_after_the_other(tiny_target, fitted, prompts, expected):
    model = tiny_target.model
    context = DraftContext(model.get_input_embeddings(), model.lm_head)
    math = SingleHead("math", fitted["math"], context, TREE)
    unbiased = SingleHead("flat", new_head(model.config, seed=3), context, TREE)
    other_tree = SingleHead("chat", fitted["chat"], context, TreeConfig(total_token=6, depth=2, top_k=2))
    for parts in ([math, unbiased], [math, other_tree], [math, NgramProposer()]):
        for proposer in (ConfidenceRouted(parts), Merged(parts, mode="rank", budget=TREE.total_token - 1)):
            assert proposer.side_by_side is None
            generations = generate(model, proposer, prompts, GREEDY, MAX_NEW, tiny_target.stop_token_ids)
            assert [g.tokens for g in generations] == expected
    # a merged tree of a stacked router and n-gram lookup: the outer merge falls back, the inner router stacks
    outer = build_proposer("confidence-routed+ngram", tiny_target, fitted, TREE)
    assert outer.side_by_side is None and outer.parts[0].side_by_side is not None
    generations = generate(model, outer, prompts, GREEDY, MAX_NEW, tiny_target.stop_token_ids)
    assert [g.tokens for g in generations] == expected
    assert sum(s.accepted for g in generations for s in g.steps) > 0


def test_heads_stop_expanding_on_their_own_confidence(tiny_target, fitted, prompts, expected):
    """With `min_confidence`, each stacked head stops at its own level, as it does alone (a fitted head is sure
    of the continuation, a random one is not)."""
    model = tiny_target.model
    context = DraftContext(model.get_input_embeddings(), model.lm_head)
    tree = TreeConfig(total_token=16, depth=4, top_k=4, min_confidence=0.05)
    parts = [SingleHead("math", fitted["math"], context, tree),
             SingleHead("random", new_head(model.config, seed=7, fc_bias=True), context, tree)]
    stacked = StackedHead([p.head for p in parts])
    sequence = prompts[0] + expected[0]
    features = model.model(torch.tensor([sequence])).last_hidden_state[0].detach()
    next_tokens = torch.tensor(sequence[1:])
    (trees,), (cache,) = draft_eagle2(stacked, parts[0].context, [HeadCache()], [features[:-1]], [next_tokens], tree)
    alone = [part.propose(HeadCache(), features[:-1], next_tokens)[0] for part in parts]
    for got, want in zip(trees, alone):
        assert_same_tree(got, want, tree_rtol(model.config.hidden_size, tree.depth))
    assert int(alone[0].depth.max()) > int(alone[1].depth.max())  # they stopped at different levels
    assert cache.length == len(next_tokens)


@pytest.mark.parametrize("name", ["confidence-routed", "entropy-routed", "merged", "math+ngram"])
def test_routers_draft_a_batch_of_sequences_as_each_alone(tiny_target, fitted, prompts, name):
    """`propose_batch` over the sequences of a decode, step by step from the inputs each got alone (drafts
    accepted, so steps hand over several positions): every sequence gets the tree and choice it gets alone (up to
    rounding and rare near-ties: batched rows run other kernels)."""
    proposer = build_proposer(name, tiny_target, fitted, TREE)
    d = tiny_target.model.config.hidden_size
    calls, accepted = [], 0
    for prompt in prompts:
        recorder = Recording(proposer)
        generation = generate(tiny_target.model, recorder, [prompt], GREEDY, MAX_NEW, tiny_target.stop_token_ids)[0]
        accepted += sum(s.accepted for s in generation.steps)
        calls.append(recorder.calls)
    assert accepted > 0
    states = [proposer.init_state() for _ in prompts]
    compared = near_ties = 0
    for step in range(min(len(c) for c in calls)):
        features = [c[step][0] for c in calls]
        next_tokens = [c[step][1] for c in calls]
        trees, states = proposer.propose_batch(states, features, next_tokens)
        for s, (tree, state) in enumerate(zip(trees, states)):
            _, _, want_tree, want_state = calls[s][step]
            if _assert_same_tree(tree, want_tree, d):
                near_ties += 1
                continue
            assert proposer.head_of(state) == proposer.head_of(want_state)
            compared += 1
    assert compared >= 4 and near_ties <= compared // 4


@pytest.mark.parametrize("stacked", [False, True])
def test_ragged_extension_runs_the_layer_on_real_tokens_and_matches_each_sequence_alone(tiny_target, fitted, prompts,
                                                                                          expected, stacked):
    """Sequences handing over different numbers of committed positions (a catch-up after the gate paused drafting:
    one row's whole prompt beside another's few tokens) extend their caches in one forward whose MLP sees only the
    real positions, not the padded rows; every row's output, root and cache are what it gets extended alone. Twice:
    the second extension starts from caches of different lengths."""
    model = tiny_target.model
    context = DraftContext(model.get_input_embeddings(), model.lm_head)
    head = StackedHead([fitted["math"], fitted["chat"]]) if stacked else fitted["math"]
    sequences = [p + e for p, e in zip(prompts, expected)] + [prompts[1] + expected[1][:2]]
    features = [model.model(torch.tensor([seq])).last_hidden_state[0].detach() for seq in sequences]
    ends = [len(seq) - 1 for seq in sequences]
    cuts = [[3, ends[0]], [ends[1] - 3, ends[1]], [1, ends[2]]]  # where each extension ends: both ragged
    mlp_tokens: list[int] = []
    handle = head.layer.mlp.register_forward_hook(lambda _m, args, _out: mlp_tokens.append(args[0].shape[-2]))
    batch = [HeadCache() for _ in sequences]
    alone = [[HeadCache()] for _ in sequences]
    rtol = rounding_rtol(model.config.hidden_size, chained=4)
    try:
        for call in range(2):
            spans = [(0 if call == 0 else cut[0], cut[call]) for cut in cuts]
            feats = [f[a:b] for f, (a, b) in zip(features, spans)]
            tokens = [torch.tensor(seq[a + 1:b + 1]) for seq, (a, b) in zip(sequences, spans)]
            counts = [len(t) for t in tokens]
            assert len(set(counts)) > 1
            mlp_tokens.clear()
            hidden, batch, roots = extend_batch(head, context, batch, feats, tokens, reserve=4)
            assert mlp_tokens == [sum(counts)]  # one forward, over the real positions only
            for s in range(len(sequences)):
                one, alone[s], root = extend_batch(head, context, alone[s], [feats[s]], [tokens[s]], reserve=4)
                rows = hidden.view(head.stacked, len(sequences), -1)[:, s]
                torch.testing.assert_close(rows, one, rtol=rtol, atol=rtol)
                assert int(roots[s]) == int(root[0]) == int(tokens[s][-1])
                assert batch[s].length == alone[s][0].length == spans[s][1]
                for got, want in zip(batch[s].kv, alone[s][0].kv):
                    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
    finally:
        handle.remove()
