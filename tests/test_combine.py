"""TAPS combinations: averaging, confidence/entropy routing, merged trees (reference, dedup, budget), diagnostics."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from taps_ray.config import TreeConfig
from taps_ray.eval import diagnostics
from taps_ray.eval.diagnostics import per_question_confidence_choice
from taps_ray.models.draft_head import DraftHead, new_head
from taps_ray.drafting.combine import (
    ConfidenceRouted,
    EntropyRouted,
    Merged,
    average_heads,
    budget_merge,
    merge_trees,
    split_budget,
)
from taps_ray.decoding.generate import generate
from taps_ray.decoding.step import StepRecord, tau
from taps_ray.drafting.proposer import NOT_DRAFTED
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.registry import UnknownProposer, build_proposer, combination_names
from taps_ray.drafting.names import averaged_weight, entropy_candidates
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.drafting.eagle2 import DraftContext, HeadCache
from taps_ray.drafting.tree import build_tree, prune_tree
from taps_ray.decoding.verify import POINT_MASS, SamplingParams, position_uniforms, processed_probs

from numerics import assert_same_tree, tree_rtol
from oracles import GreedyOracle, fit_head

GREEDY = SamplingParams()
TREE = TreeConfig(total_token=8, depth=3, top_k=3)
MAX_NEW = 8


def _context(target) -> DraftContext:
    return DraftContext(target.model.get_input_embeddings(), target.model.lm_head)


def _sharp_head(config, seed: int, scale: float = 30.0, device: torch.device | str = "cpu") -> DraftHead:
    """A random head with a scaled-up fc: larger outputs, sharper draft distributions, confident trees."""
    head = new_head(config, seed=seed, device=device)
    with torch.no_grad():
        head.fc.weight.mul_(scale)
    return head


def _heads(target) -> dict[str, DraftHead]:
    config, device = target.model.config, target.device
    return {"math": _sharp_head(config, seed=1, scale=20.0, device=device), "chat": new_head(config, seed=2, device=device)}


def _hf_greedy(target, prompt: list[int], n: int, stops: list[int] | None) -> list[int]:
    """HF greedy on the target's device; `stops` None: the model's own end-of-sequence tokens."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=stops, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def heads(tiny_target) -> dict[str, DraftHead]:
    return _heads(tiny_target)


@pytest.fixture(scope="module")
def expected(tiny_target, prompts) -> list[list[int]]:
    model, stops = tiny_target.model, tiny_target.stop_token_ids
    outs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stops, pad_token_id=0
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module")
def fitted_heads(tiny_target, prompts, expected) -> dict[str, DraftHead]:
    """Heads fitted to the target's continuations of `prompts` (same start weights): combinations accept drafts."""
    sequences = [p + e for p, e in zip(prompts, expected)]
    return {"math": fit_head(tiny_target, sequences, steps=30), "chat": fit_head(tiny_target, sequences[1:], steps=20)}


@pytest.fixture(scope="module")
def probe(tiny_target):
    """(features, next_tokens) of a prompt, as the loop hands them to a proposer on its first call."""
    prompt = tiny_target.tokenizer.encode("The quick brown fox")
    features = tiny_target.model.model(torch.tensor([prompt])).last_hidden_state[0]
    return features, torch.tensor(prompt[1:] + [42])


# --- registry and losslessness -------------------------------------------------------------------------------


def test_registered_names():
    assert combination_names() == ["averaged-w0", "averaged-w0.25", "averaged", "averaged-w0.75", "averaged-w1",
                                   "confidence-routed", "entropy-routed", "merged", "merged-dedup", "merged-budget",
                                   "learned-routed"]
    assert averaged_weight("averaged-w0.25") == 0.25 and averaged_weight("averaged") == 0.5
    assert averaged_weight("merged") is None


@pytest.mark.parametrize("name", combination_names())
def test_every_combination_is_lossless_greedy(device_target, heads, fitted_heads, prompts, expected, name):
    device = device_target.device
    accepting = build_proposer(name, device_target, {k: h.to(device) for k, h in fitted_heads.items()}, TREE)
    stops = device_target.stop_token_ids
    generations = generate(device_target.model, accepting, prompts, GREEDY, MAX_NEW, stops)
    assert [g.tokens for g in generations] == expected
    assert sum(s.accepted for g in generations for s in g.steps) > 0  # not vacuous: drafts were accepted
    proposer = build_proposer(name, device_target, _heads(device_target), TREE)
    generations = generate(device_target.model, proposer, prompts, GREEDY, MAX_NEW, stops)
    for generation, prompt in zip(generations, prompts):
        assert generation.tokens == _hf_greedy(device_target, prompt, MAX_NEW, stops)
        heads_used = {s.head for s in generation.steps}
        if name.startswith("merged"):
            assert heads_used == {-1}
        if name == "merged-budget":
            assert all(s.tree_size == TREE.total_token for s in generation.steps)
        elif name == "confidence-routed":
            assert heads_used <= {0, 1}


def test_combination_needs_two_heads(tiny_target, heads):
    with pytest.raises(ValueError, match="combines two heads"):
        build_proposer("merged", tiny_target, {"math": heads["math"]}, TREE)
    with pytest.raises(UnknownProposer, match="unknown proposer 'merged-twice'"):
        build_proposer("merged-twice", tiny_target, heads, TREE)


def test_any_averaging_weight_builds_and_a_bad_one_names_the_fix(tiny_target, heads):
    proposer = build_proposer("averaged-w0.3", tiny_target, heads, TREE)
    assert proposer.name == "averaged-w0.3"
    want = average_heads(heads["math"], heads["chat"], 0.3).trainable_state()
    got = proposer.head.trainable_state()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for bad in ("averaged-w1.5", "averaged-w", "averaged-wx", "averaged-wnan"):
        with pytest.raises(UnknownProposer, match=r"must be a number in \[0, 1\].*averaged-w0.3"):
            build_proposer(bad, tiny_target, heads, TREE)


def test_merged_variants_with_an_accepting_oracle_are_lossless(device_target):
    """Oracle + random head: real acceptances through the merged tree; dedup accepts exactly as plain merge."""
    model, tok = device_target.model, device_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompt = [bos] + tok.encode("math: 12*7=")
    want = _hf_greedy(device_target, prompt, 10, None)
    random_part = SingleHead("chat", _heads(device_target)["chat"], _context(device_target), TREE)
    results = {}
    for mode in ("concat", "dedup", "budget"):
        merged = Merged([GreedyOracle(model, first_token=bos, depth=3), random_part], mode=mode, budget=TREE.total_token - 1)
        generation = generate(model, merged, [prompt], GREEDY, 10, [])[0]
        assert generation.tokens == want
        results[mode] = generation
    assert max(s.accepted for s in results["concat"].steps) == 3
    assert [s.accepted for s in results["dedup"].steps] == [s.accepted for s in results["concat"].steps]
    assert all(d.tree_size <= c.tree_size for d, c in zip(results["dedup"].steps, results["concat"].steps))
    assert all(s.tree_size == TREE.total_token for s in results["budget"].steps)
    routed = ConfidenceRouted([GreedyOracle(model, first_token=bos, depth=3), random_part])
    assert generate(model, routed, [prompt], GREEDY, 10, [])[0].tokens == want


def test_sampling_runs_through_the_loop(tiny_target, heads, prompts):
    for name in ("merged-budget", "confidence-routed"):
        proposer = build_proposer(name, tiny_target, heads, TREE)
        generation = generate(tiny_target.model, proposer, prompts[1:], SamplingParams(temperature=1.0), 4, [], seeds=[3])[0]
        assert len(generation.tokens) == 4


# --- routing -------------------------------------------------------------------------------------------------


def test_confidence_routing_picks_the_sharper_head_and_keeps_both_caches(tiny_target, probe):
    config, context = tiny_target.model.config, _context(tiny_target)
    sharp, flat = _sharp_head(config, seed=1), new_head(config, seed=2)
    features, next_tokens = probe
    sharp_tree, _ = SingleHead("s", sharp, context, TREE).propose(HeadCache(), features, next_tokens)
    flat_tree, _ = SingleHead("f", flat, context, TREE).propose(HeadCache(), features, next_tokens)
    assert sharp_tree.mean_confidence > flat_tree.mean_confidence
    assert sharp_tree.mean_entropy < flat_tree.mean_entropy
    for order, sharp_index in ((("sharp", "flat"), 0), (("flat", "sharp"), 1)):
        named = {"sharp": sharp, "flat": flat}
        heads = {n: named[n] for n in order}
        router = build_proposer("confidence-routed", tiny_target, heads, TREE)
        tree, state = router.propose(router.init_state(), features, next_tokens)
        assert state.last_head == sharp_index
        # the router drafts both heads stacked (bmm), the reference one head alone (mm): equal up to rounding
        rtol = tree_rtol(config.hidden_size, TREE.depth)
        assert not assert_same_tree(tree, sharp_tree, rtol), "a sharp head's tree has no near-tie"
        assert state.confidences[sharp_index] == pytest.approx(sharp_tree.mean_confidence, rel=rtol)
        assert state.stacked.length == len(next_tokens)  # both heads' stacked stable caches advanced
        entropy = build_proposer("entropy-routed", tiny_target, heads, TREE)
        tree, state = entropy.propose(entropy.init_state(), features, next_tokens)
        assert state.last_head == state.chosen == sharp_index and torch.equal(tree.tokens, sharp_tree.tokens)
        assert state.parts[1 - sharp_index] is None  # the other head's cache is dropped
        # later calls: only the chosen head drafts, from its own cache
        tree, state = entropy.propose(state, features[-1:], torch.tensor([7]))
        assert state.last_head == sharp_index and state.parts[sharp_index].length == len(next_tokens) + 1


def test_entropy_routing_candidates_are_every_head_and_the_averaged_head(tiny_target, probe):
    """TAPS's entropy router picks among MathInstruct, ShareGPT, the mixed head and the averaged head."""
    config = tiny_target.model.config
    heads = {"math": new_head(config, seed=2), "chat": new_head(config, seed=3), "mixed": new_head(config, seed=4)}
    router = build_proposer("entropy-routed", tiny_target, heads, TREE)
    assert router.head_names == entropy_candidates(list(heads)) == ["math", "chat", "mixed", "averaged"]
    averaged = router.parts[3].head.trainable_state()
    for key, value in heads["math"].trainable_state().items():
        if value.is_floating_point():
            expected = 0.5 * value + 0.5 * heads["chat"].trainable_state()[key]
            assert torch.allclose(averaged[key], expected, atol=1e-6), key
    features, next_tokens = probe
    _, state = router.propose(router.init_state(), features, next_tokens)
    assert len(state.entropies) == 4 and state.chosen == min(range(4), key=lambda i: (state.entropies[i], i))
    assert entropy_candidates(["math"]) == ["math"]  # one head: nothing to average


def test_routing_ties_go_to_head_a(tiny_target, probe):
    config, context = tiny_target.model.config, _context(tiny_target)
    twin = [SingleHead(n, new_head(config, seed=5), context, TREE) for n in ("a", "b")]
    features, next_tokens = probe
    for router in (ConfidenceRouted(twin), EntropyRouted(twin)):
        _, state = router.propose(router.init_state(), features, next_tokens)
        assert state.last_head == 0


def test_routing_records_in_steps(tiny_target, prompts):
    config = tiny_target.model.config
    heads = {"flat": new_head(config, seed=2), "sharp": _sharp_head(config, seed=1)}
    for name in ("confidence-routed", "entropy-routed"):
        proposer = build_proposer(name, tiny_target, heads, TREE)
        generation = generate(tiny_target.model, proposer, prompts[:1], GREEDY, 4, [])[0]
        assert {s.head for s in generation.steps} == {1}
        assert diagnostics.routing_fractions(generation.steps, list(heads)) == {"sharp": 1.0}


# --- merged trees --------------------------------------------------------------------------------------------


def _spec_merge(a, b):
    """docs/algorithms.md#merged-tree-verification written out: mask blocks, positions and retrieve rows of the reference merge."""
    na, nb = a.size - 1, b.size - 1
    n = na + nb + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    mask[1 : na + 1, 0 : na + 1] = a.mask[1:, :]
    mask[na + 1 :, 0] = True
    mask[na + 1 :, na + 1 :] = b.mask[1:, 1:]
    depth = torch.cat([a.depth, b.depth[1:]])
    width = max(a.retrieve.shape[1], b.retrieve.shape[1])
    pad = lambda r: torch.cat([r, torch.full((r.shape[0], width - r.shape[1]), -1)], dim=1)  # noqa: E731
    rb = torch.where(b.retrieve > 0, b.retrieve + na, b.retrieve)
    return mask, depth, torch.cat([pad(a.retrieve), pad(rb)])


def test_merged_tree_blocks_on_hand_built_trees():
    a = build_tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1, 1]), confidence=torch.tensor([0.9, 0.5, 0.3]))
    b = build_tree(torch.tensor([9, 1, 4, 5]), torch.tensor([-1, 0, 0, 1]), confidence=torch.tensor([0.8, 0.1, 0.4]))
    merged = merge_trees([a, b])
    assert merged.tokens.tolist() == [9, 1, 2, 3, 1, 4, 5]
    assert merged.parents.tolist() == [-1, 0, 1, 1, 0, 0, 4]
    assert merged.source.tolist() == [0, 0, 0, 1, 1, 1]
    assert merged.confidence.tolist() == pytest.approx([0.9, 0.5, 0.3, 0.8, 0.1, 0.4])
    mask, depth, retrieve = _spec_merge(a, b)
    assert torch.equal(merged.mask, mask) and torch.equal(merged.depth, depth)
    assert merged.retrieve.tolist() == retrieve.tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, 6], [0, 5, -1]]
    assert not merged.mask[4:, 1:4].any() and merged.mask[4:, 0].all()  # B rows see the root, never A
    dedup = merge_trees([a, b], dedup=True)
    assert dedup.tokens.tolist() == [9, 1, 2, 3, 4, 5] and dedup.parents.tolist() == [-1, 0, 1, 1, 0, 1]
    assert dedup.source.tolist() == [0, 0, 0, 1, 1]  # the shared node keeps A's statistics and source
    assert dedup.retrieve.tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 5], [0, 4, -1]]
    with pytest.raises(ValueError, match="share the root"):
        merge_trees([a, build_tree(torch.tensor([8, 1]), torch.tensor([-1, 0]))])


def test_merged_tree_of_real_heads_follows_the_spec(tiny_target, probe):
    config, context = tiny_target.model.config, _context(tiny_target)
    parts = [SingleHead(n, new_head(config, seed=seed), context, TREE) for n, seed in (("a", 1), ("b", 3))]
    features, next_tokens = probe
    merged, state = Merged(parts).propose(Merged(parts).init_state(), features, next_tokens)
    a, _ = parts[0].propose(HeadCache(), features, next_tokens)
    b, _ = parts[1].propose(HeadCache(), features, next_tokens)
    mask, depth, retrieve = _spec_merge(a, b)
    assert torch.equal(merged.mask, mask) and torch.equal(merged.depth, depth) and torch.equal(merged.retrieve, retrieve)
    assert state.last_head == -1 and state.stacked.length == len(next_tokens)
    # identical heads: dedup collapses the merged tree onto one tree
    twins = [parts[0], SingleHead("a2", new_head(config, seed=1), context, TREE)]
    dedup, _ = Merged(twins, mode="dedup").propose(Merged(twins).init_state(), features, next_tokens)
    plain, _ = Merged(twins).propose(Merged(twins).init_state(), features, next_tokens)
    assert plain.size == 2 * TREE.total_token - 1 and dedup.size == TREE.total_token
    assert torch.equal(dedup.tokens, a.tokens) and torch.equal(dedup.mask, a.mask)


def test_prune_keeps_closed_top_nodes(tiny_target, probe):
    wide = TreeConfig(total_token=20, depth=4, top_k=3)
    head = SingleHead("a", new_head(tiny_target.model.config, seed=4), _context(tiny_target), wide)
    tree, _ = head.propose(HeadCache(), *probe)
    for n in range(0, tree.size):
        pruned = prune_tree(tree, n)  # build_tree raises if a kept node lost its parent
        assert pruned.size == n + 1
        top = sorted(tree.confidence.tolist(), reverse=True)[:n]
        assert sorted(pruned.confidence.tolist(), reverse=True) == pytest.approx(top)
    # ties and non-monotone scores still give closed trees (a node never outranks its parent)
    odd = build_tree(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]), confidence=torch.tensor([0.2, 0.9, 0.2]))
    assert prune_tree(odd, 2).tokens.tolist() == [0, 1, 2]


def test_split_budget():
    assert split_budget(7, [0.3, 0.1]) == [5, 2]
    assert split_budget(7, [1.0, 0.0]) == [6, 1]  # at least one node each
    assert split_budget(7, [0.0, 0.0]) == [4, 3]
    assert split_budget(1, [0.1, 0.2]) == [0, 1]
    assert sum(split_budget(59, [0.37, 0.11, 0.05])) == 59


def test_budget_merge_uses_exactly_the_budget(tiny_target, probe):
    config, context = tiny_target.model.config, _context(tiny_target)
    features, next_tokens = probe
    budget = TREE.total_token - 1
    pairs = ((_sharp_head(config, 1), new_head(config, seed=2)), (new_head(config, seed=1), new_head(config, seed=1)))
    for a_head, b_head in pairs:
        parts = [SingleHead("a", a_head, context, TREE), SingleHead("b", b_head, context, TREE)]
        proposer = Merged(parts, mode="budget", budget=budget)
        tree, state = proposer.propose(proposer.init_state(), features, next_tokens)
        assert tree.size - 1 == budget and sum(state.shares) == budget and state.last_head == -1
        if state.confidences[0] > 10 * state.confidences[1]:
            assert state.shares[0] > state.shares[1]
    # hand-built: B repeats A's best path, so B's share comes from its own new nodes
    a = build_tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]), confidence=torch.tensor([0.9, 0.6, 0.05]))
    b = build_tree(torch.tensor([9, 1, 4, 5]), torch.tensor([-1, 0, 1, 0]), confidence=torch.tensor([0.8, 0.4, 0.3]))
    tree = budget_merge([a, b], budget=3, shares=[2, 1])
    assert tree.tokens.tolist() == [9, 1, 2, 4] and tree.source.tolist() == [0, 0, 1]
    assert budget_merge([a, b], budget=10, shares=[5, 5]).size - 1 == 5  # only 5 distinct nodes exist


# --- sampling: lossless on a small vocabulary ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "prompt", "root"),
    [("merged", [1, 2, 3], 4), ("merged-dedup", [1, 2, 3], 4), ("math+ngram", [1, 2, 3, 1, 2], 3)],
)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_merged_sampling_is_lossless_chi_square(small_vocab_target, name, prompt, root, params):
    """One drafted merged tree, verified by the target; the first two committed tokens follow the target exactly.
    `math+ngram`: the repeated prompt gives a prompt-lookup chain, one-hot drafts beside the head's."""
    model = small_vocab_target.model
    config = model.config
    tree_cfg = TreeConfig(total_token=7, depth=2, top_k=3)
    heads = {"math": _sharp_head(config, seed=1, scale=5.0), "chat": new_head(config, seed=2)}
    proposer = build_proposer(name, small_vocab_target, heads, tree_cfg)
    features = model.model(torch.tensor([prompt])).last_hidden_state[0]
    tree, _ = proposer.propose(proposer.init_state(), features, torch.tensor(prompt[1:] + [root]))
    assert int(tree.depth.max()) >= 2
    if name == "merged":
        assert tree.size == 13 and len(set(tree.tokens[tree.depth == 1].tolist())) < int((tree.depth == 1).sum())
    if name == "math+ngram":
        assert tree.size == 7 and 1 in tree.source.tolist()  # n-gram nodes made the budget
    batch = TargetBatch(model)
    batch.prefill([prompt])
    logits = batch.forward_trees([tree])[0][0]
    vocab = config.vocab_size
    p1 = processed_probs(model(torch.tensor([prompt + [root]])).logits[0, -1], params)
    p2 = torch.stack(
        [processed_probs(model(torch.tensor([prompt + [root, x]])).logits[0, -1], params) for x in range(vocab)]
    )
    generator = torch.Generator().manual_seed(0)
    runs = 3000
    counts = torch.zeros(vocab, vocab)
    uniforms = position_uniforms(torch.arange(runs), torch.arange(1, tree.size + 1).expand(runs, -1))
    for verdict in POINT_MASS.verdicts([tree] * runs, logits.expand(runs, -1, -1), [params] * runs, uniforms):
        path = verdict.tokens[1:] + [verdict.bonus]
        second = path[1] if len(path) > 1 else int(torch.multinomial(p2[path[0]], 1, generator=generator))
        counts[path[0], second] += 1
    exact = (p1[:, None] * p2).flatten() * runs
    keep = exact > 0
    observed = counts.flatten()[keep]
    assert counts.flatten()[~keep].sum() == 0
    assert stats.chisquare(observed, exact[keep] * observed.sum() / exact[keep].sum()).pvalue > 1e-3


# --- averaging -----------------------------------------------------------------------------------------------


def test_averaging_endpoints_and_midpoint(tiny_target, probe):
    config, context = tiny_target.model.config, _context(tiny_target)
    a, b = new_head(config, seed=1), new_head(config, seed=2)
    features, next_tokens = probe

    def tree_of(head):
        return SingleHead("x", head, context, TREE).propose(HeadCache(), features, next_tokens)[0]

    for w, reference in ((1.0, a), (0.0, b)):
        averaged = average_heads(a, b, w)
        for key, value in averaged.trainable_state().items():
            assert torch.equal(value, reference.trainable_state()[key])
        got, want = tree_of(averaged), tree_of(reference)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
        assert torch.equal(got.confidence, want.confidence)
    mid = average_heads(a, b, 0.25).trainable_state()
    torch.testing.assert_close(mid["fc.weight"], 0.25 * a.fc.weight + 0.75 * b.fc.weight)
    for w, name in ((1.0, "averaged-w1"), (0.0, "averaged-w0")):
        proposer = build_proposer(name, tiny_target, {"math": a, "chat": b}, TREE)
        assert torch.equal(proposer.propose(HeadCache(), features, next_tokens)[0].tokens, tree_of(a if w else b).tokens)
    half = build_proposer("averaged", tiny_target, {"math": a, "chat": b}, TREE)
    up = lambda h: h.layer.mlp.up_proj.weight  # noqa: E731
    torch.testing.assert_close(up(half.head), 0.5 * (up(a) + up(b)))


def test_averaging_rejects_mismatched_heads(tiny_target):
    config = tiny_target.model.config
    a = new_head(config, seed=1)
    with pytest.raises(ValueError, match="different parameters.*fc.bias"):
        average_heads(a, new_head(config, seed=2, fc_bias=True), 0.5)
    other = DraftHead(a.config.model_copy(update={"intermediate_size": a.config.intermediate_size + 8}))
    with pytest.raises(ValueError, match="different shapes"):
        average_heads(a, other, 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        average_heads(a, a, 1.5)


# --- post-hoc router and diagnostics -------------------------------------------------------------------------


def _record(conf, ent, acc, src=None, head=0, new_tokens=1) -> StepRecord:
    return StepRecord(
        accepted=sum(acc), new_tokens=new_tokens, tree_size=len(conf) + 1, draft_s=0.0, verify_s=0.0, head=head,
        node_confidence=conf, node_entropy=ent, node_accepted=acc, node_source=src or [0] * len(conf),
    )


def test_per_question_confidence_choice():
    hi = [_record([0.5, 0.3], [1.0, 1.0], [True, False])]
    lo = [_record([0.2, 0.1], [1.0, 1.0], [False, False])]
    near = [_record([0.405, 0.4], [1.0, 1.0], [False, False])]
    assert per_question_confidence_choice({"math": hi, "chat": lo, "mixed": lo}) == "math"
    assert per_question_confidence_choice({"math": lo, "chat": hi, "mixed": lo}) == "chat"
    assert per_question_confidence_choice({"math": hi, "chat": lo}) == "math"
    assert per_question_confidence_choice({"math": hi, "chat": near, "mixed": lo}) == "mixed"  # |0.4 - 0.4025| < eps
    assert per_question_confidence_choice({"math": hi, "chat": near}, fallback=None) == "math"


def test_accepted_vs_rejected_and_fractions():
    records = [
        _record([0.9, 0.5, 0.1], [1.0, 2.0, 3.0], [True, False, False], src=[0, 0, 1], head=-1),
        _record([0.8, 0.2], [0.5, 4.0], [True, True], src=[1, 1], head=-1),
        _record([], [], [], head=0),
    ]
    stats_ = diagnostics.accepted_vs_rejected(records)
    assert stats_["n_accepted"] == 3 and stats_["n_rejected"] == 2
    assert stats_["entropy_accepted"] == pytest.approx((1.0 + 0.5 + 4.0) / 3)
    assert stats_["confidence_rejected"] == pytest.approx(0.3)
    assert stats_["delta_entropy"] == pytest.approx(2.5 - 5.5 / 3)
    assert stats_["delta_confidence"] == pytest.approx(1.9 / 3 - 0.3)
    only_b = diagnostics.accepted_vs_rejected(records, source=1)
    assert only_b["n_accepted"] == 2 and only_b["n_rejected"] == 1
    assert math.isnan(diagnostics.accepted_vs_rejected([])["entropy_accepted"])
    assert diagnostics.routing_fractions(records) == {-1: pytest.approx(2 / 3), 0: pytest.approx(1 / 3)}
    named = diagnostics.routing_fractions(records, ["math", "chat"])
    assert named == {"merged": pytest.approx(2 / 3), "math": pytest.approx(1 / 3)}
    paused = [*records, _record([], [], [], head=NOT_DRAFTED)]  # drafting paused: a step that verified only the root
    assert diagnostics.routing_fractions(paused, ["math", "chat"]) == {
        "none": pytest.approx(1 / 4), "merged": pytest.approx(2 / 4), "math": pytest.approx(1 / 4)}
    assert tau(records) == 1.0


def test_signal_agreement():
    confidence = {"math": [0.9, 0.2, 0.5, 0.4], "chat": [0.1, 0.8, 0.5, 0.6]}
    entropy = {"math": [0.5, 0.4, 2.0, 1.0], "chat": [1.5, 0.9, 1.0, 1.0]}
    tau = {"math": [3.0, 2.0, 1.5, 2.0], "chat": [2.0, 2.5, 2.5, 2.0]}
    out = diagnostics.signal_agreement(confidence, entropy, tau)
    # q0 math best: conf math ok, ent math ok; q1 chat best: conf chat ok, ent math wrong;
    # q2 chat best: conf tie -> math wrong, ent chat ok; q3 tie in tau: both ok
    assert out["questions"] == 4 and out["decisive"] == 3
    assert out["confidence_accuracy"] == 0.75 and out["entropy_accuracy"] == 0.75
    assert out["confidence_routed_tau"] == pytest.approx((3.0 + 2.5 + 1.5 + 2.0) / 4)
    assert out["entropy_routed_tau"] == pytest.approx((3.0 + 2.0 + 2.5 + 2.0) / 4)
    assert out["oracle_tau"] == pytest.approx((3.0 + 2.5 + 2.5 + 2.0) / 4)
    assert out["head_tau"] == {"math": pytest.approx(2.125), "chat": pytest.approx(2.25)}
    with pytest.raises(ValueError, match="questions"):
        diagnostics.signal_agreement(confidence, entropy, {"math": [1.0], "chat": [1.0]})
