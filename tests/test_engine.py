"""The decoding engine: tree invariants, tree verification, lossless greedy and sampled decoding, batches."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, replace

import pytest
import torch
from scipy import stats

from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import new_head
from taps_ray.decoding.generate import generate, run_loop
from taps_ray.decoding.replay import TraceVerifier, record_traces
from taps_ray.decoding.step import step_tokens
from taps_ray.drafting.proposer import NOT_DRAFTED, Feedback
from taps_ray.drafting.proposers import PlainDecoding, SingleHead
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.models.target_forward import target_forward
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, draft_eagle2, extend_batch
from taps_ray.drafting.tree import build_tree, pad_trees, root_only, subtree
from taps_ray.decoding.verify import (
    POINT_MASS, PointMass, SamplingParams, position_uniforms, processed_probs,
)

from oracles import FixedTree, GreedyOracle, OracleState, Recording, fit_head

GREEDY = SamplingParams()


def _hf_greedy(model, prompt: list[int], n: int, stop_ids: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False, eos_token_id=stop_ids,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _random_head_proposer(target, tree: TreeConfig, seed: int = 0) -> SingleHead:
    head = new_head(target.model.config, seed=seed, device=target.device)
    context = DraftContext(target.model.get_input_embeddings(), target.model.lm_head)
    return SingleHead("random", head, context, tree)


# --- trees ---------------------------------------------------------------------------------------------------


def test_worked_example_tree_mask_positions_retrieve():
    tree = build_tree(torch.tensor([7, 1, 2, 3]), torch.tensor([-1, 0, 1, 1]))
    assert tree.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    assert tree.depth.tolist() == [0, 1, 2, 2]
    assert tree.retrieve.tolist() == [[0, 1, 2], [0, 1, 3]]


def test_build_tree_rejects_child_before_parent():
    with pytest.raises(ValueError, match="parent must precede"):
        build_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))


def test_eagle2_tree_invariants(tiny_target):
    proposer = _random_head_proposer(tiny_target, TreeConfig(total_token=20, depth=4, top_k=3))
    prompt = tiny_target.tokenizer.encode("The quick brown fox")
    features = tiny_target.model.model(torch.tensor([prompt])).last_hidden_state[0]
    tree, cache = proposer.propose(HeadCache(), features, torch.tensor(prompt[1:] + [42]))
    assert tree.size == 20 and int(tree.tokens[0]) == 42 and cache.length == len(prompt)
    parents = tree.parents.tolist()
    assert all(0 <= parents[j] < j for j in range(1, tree.size))
    for j in range(tree.size):
        ancestors = {j}
        node = j
        while parents[node] >= 0:
            node = parents[node]
            ancestors.add(node)
        assert set(tree.mask[j].nonzero().flatten().tolist()) == ancestors
        assert int(tree.depth[j]) == len(ancestors) - 1
    on_rows = set(tree.retrieve[tree.retrieve >= 0].tolist())
    assert on_rows == set(range(tree.size))
    for row in tree.retrieve.tolist():
        path = [n for n in row if n >= 0]
        assert all(parents[c] == p for p, c in zip(path, path[1:]))
    # confidences are cumulative probabilities: a child is never more confident than its parent
    conf = torch.cat([torch.ones(1), tree.confidence])
    assert all(conf[j] <= conf[parents[j]] + 1e-6 for j in range(1, tree.size))
    assert (tree.entropy >= 0).all()


def test_tree_verified_logits_equal_sequential_logits(forward_target):
    model = forward_target.model
    prompt = forward_target.tokenizer.encode("Tree attention must equal sequential decoding")
    tree = build_tree(torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    batch = TargetBatch(model)
    batch.prefill([prompt])
    logits = batch.forward_trees([tree])[0][0]
    for node in range(tree.size):
        path = tree.mask[node].nonzero().flatten()
        sequential = model(torch.tensor([prompt + tree.tokens[path].tolist()])).logits[0, -1]
        torch.testing.assert_close(logits[node], sequential, atol=1e-4, rtol=1e-4)


class _MaskSpy:
    """A target forward that records the mask of every call."""

    def __init__(self, forward) -> None:
        self.forward, self.masks = forward, []

    def __call__(self, ids, positions, mask, *rest):
        self.masks.append(mask)
        return self.forward(ids, positions, mask, *rest)

    def __getattr__(self, name: str):
        return getattr(self.forward, name)


def test_ragged_prefill_is_unmasked_and_gives_each_prompt_its_own_prefill(forward_target):
    """Prompts of different lengths prefill in one plain causal forward per length (no mask: the fast kernels; no
    padding computed), and each prompt's features and last-token logits are those of its prefill alone."""
    prompt = forward_target.tokenizer.encode("Tree attention must equal sequential decoding")
    ragged = [prompt, prompt[:4], prompt[1:3], prompt[2:6]]  # two of length 4
    spy = _MaskSpy(target_forward(forward_target.model))
    outputs = TargetBatch(forward_target.model, forward=spy).prefill(ragged)
    assert len(prompt) > 4 and spy.masks == [None, None, None]  # one forward per length
    for context, out in zip(ragged, outputs):
        (alone,) = TargetBatch(forward_target.model).prefill([context])
        torch.testing.assert_close(out.hidden, alone.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits, alone.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.logits.argmax(-1), alone.logits.argmax(-1))


def test_eager_attention_masks_the_tree_like_sdpa(tiny_config):
    """Eager attention adds a 4-D mask to the scores: TargetBatch hands it the additive form, so tree logits equal
    sequential decoding (a boolean mask would mask nothing: measured 0.16 apart on this tree)."""
    from taps_ray.models.target import load_target

    eager = load_target(tiny_config.target.model_copy(update={"attn_implementation": "eager", "forward": "hf"}))
    assert eager.model.config._attn_implementation == "eager"
    prompt = eager.tokenizer.encode("Tree attention must equal sequential decoding")
    tree = build_tree(torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    batch = TargetBatch(eager.model)
    batch.prefill([prompt, prompt[:4]])  # a padded batch: the shorter row's padding must be masked too
    logits = batch.forward_trees([tree, tree])[0]
    for b, context in enumerate((prompt, prompt[:4])):
        for node in range(tree.size):
            path = tree.mask[node].nonzero().flatten()
            sequential = eager.model(torch.tensor([context + tree.tokens[path].tolist()])).logits[0, -1]
            torch.testing.assert_close(logits[b, node], sequential, atol=1e-4, rtol=1e-4)


def test_draft_stable_cache_equals_fresh_prefill(tiny_target):
    head = new_head(tiny_target.model.config, seed=1)
    context = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    features = torch.randn(9, head.config.hidden_size)
    tokens = torch.randint(0, 1000, (9,))
    tree = TreeConfig(total_token=6, depth=2, top_k=2)
    _, (cache,) = draft_eagle2(head, context, [HeadCache()], [features[:5]], [tokens[:5]], tree)
    _, (cache,) = draft_eagle2(head, context, [cache], [features[5:]], [tokens[5:]], tree)
    _, (fresh,), _ = extend_batch(head, context, [HeadCache()], [features], [tokens])
    torch.testing.assert_close(cache.kv[0], fresh.kv[0])
    torch.testing.assert_close(cache.kv[1], fresh.kv[1])
    assert cache.length == fresh.length == 9


# --- lossless greedy -----------------------------------------------------------------------------------------


def test_greedy_equals_hf_generate_random_head_batch(device_target):
    model, tok = device_target.model, device_target.tokenizer
    prompts = [tok.encode("Hello there, how are you"), tok.encode("x"), list(range(100, 180)), tok.encode("2+2=")]
    proposer = _random_head_proposer(device_target, TreeConfig(total_token=8, depth=3, top_k=3))
    stops = device_target.stop_token_ids
    batched = generate(model, proposer, prompts, GREEDY, 24, stops)
    expected = [_hf_greedy(model, prompt, 24, stops) for prompt in prompts]
    for want, generation in zip(expected, batched):
        assert generation.tokens == want
    # the same batch with a head fitted to these continuations: drafts are accepted, and the output is unchanged
    fitted = SingleHead("fitted", fit_head(device_target, [p + e for p, e in zip(prompts, expected)]),
                        proposer.context, proposer.tree)
    accepting = generate(model, fitted, prompts, GREEDY, 24, stops)
    assert [g.tokens for g in accepting] == expected
    assert sum(s.accepted for g in accepting for s in g.steps) > 0


def test_greedy_oracle_accepts_and_stays_lossless_batch_and_alone(device_target):
    model, tok = device_target.model, device_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("a long prompt about numbers 1 2 3 4 5 6 7 8", "hi", "math: 12*7=")]
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    plain = generate(model, PlainDecoding(), prompts, GREEDY, 30, [])
    batched = generate(model, oracle, prompts, GREEDY, 30, [])
    for b, prompt in enumerate(prompts):
        alone = generate(model, oracle, [prompt], GREEDY, 30, [])[0]
        expected = _hf_greedy(model, prompt, 30, [])
        assert plain[b].tokens == expected
        assert batched[b].tokens == expected
        assert alone.tokens == expected
        assert [s.accepted for s in alone.steps] == [s.accepted for s in batched[b].steps]
        assert max(s.accepted for s in alone.steps) == 4  # full chains were accepted
        assert alone.tau > 1.5


@dataclass
class Watching(GreedyOracle):
    """The oracle, keeping every `observe` call and handing back fresh states, so a test sees that the loop
    drafts the next step from the states `observe` returned."""

    calls: list[list[Feedback]] = field(default_factory=list)
    returned: list[int] = field(default_factory=list)  # ids of the states `observe` handed back
    drafted_from: list[int] = field(default_factory=list)  # ids of the states `propose` was given

    def propose(self, state: OracleState, features: torch.Tensor, next_tokens: torch.Tensor):
        self.drafted_from.append(id(state))
        return super().propose(state, features, next_tokens)

    def observe(self, states: list[OracleState], feedback: list[Feedback]) -> list[OracleState]:
        self.calls.append(feedback)
        fresh = [replace(state) for state in states]
        self.returned += [id(state) for state in fresh]
        return fresh


def test_observe_hands_each_proposer_what_verification_accepted_per_sequence(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("a long prompt about numbers 1 2 3 4", "math: 12*7=")]
    oracle = Watching(model, first_token=bos, depth=4)
    generations = generate(model, oracle, prompts, GREEDY, 20, [])
    steps = max(len(g.steps) for g in generations)
    assert len(oracle.calls) == steps  # one call per step for the whole batch, as drafting is
    for b, generation in enumerate(generations):
        feedback = [call[b] for call in oracle.calls if len(call) > b]  # sequence b's, while it decodes
        assert [f.accepted for f in feedback] == [s.accepted for s in generation.steps]
        assert max(f.accepted for f in feedback) > 0
        committed = [generation.tokens[0]] + [t for f in feedback for t in f.tokens]
        assert committed[: len(generation.tokens)] == generation.tokens
        for f in feedback:  # the accepted path's drafted tokens, then the bonus
            assert f.nodes[0] == 0 and f.tree.tokens[f.nodes[1:]].tolist() == f.tokens[:-1]
    assert set(oracle.drafted_from[len(prompts):]) <= set(oracle.returned)  # after the first, observe's states

    paused = Watching(model, first_token=bos, depth=4)
    run_loop(TargetBatch(model), paused, prompts, GREEDY, 8, [], draft_below=1)  # never drafts
    assert paused.calls == [] and paused.drafted_from == []


def test_stop_token_inside_accepted_block_cuts_output(forward_target):
    model, tok = forward_target.model, forward_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompt = [bos] + tok.encode("stop me somewhere")
    expected = _hf_greedy(model, prompt, 30, [])
    stop = expected[5]  # a token the target will emit mid-tree
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    generation = generate(model, oracle, [prompt], GREEDY, 30, [stop])[0]
    assert generation.finished_by == "stop"
    assert generation.tokens == expected[: expected.index(stop) + 1]
    assert generation.tokens == _hf_greedy(model, prompt, 30, [stop])


def test_spec_bench_new_tokens_trim_after_a_stop_token_but_not_at_the_token_budget(forward_target):
    model, tok = forward_target.model, forward_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompt = [bos] + tok.encode("budget me somewhere")
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    budget = 6  # the oracle commits 1, 2, 3 tokens in steps 0, 1, 2: step 2 crosses the budget
    cut = generate(model, oracle, [prompt], GREEDY, budget, [])[0]
    assert cut.finished_by == "length" and len(cut.tokens) == budget
    # every step, the last included, counts all it committed (a_k + 1); the output itself is cut at the budget
    assert [s.new_tokens for s in cut.steps] == [s.accepted + 1 for s in cut.steps]
    assert sum(s.new_tokens for s in cut.steps) + 1 > budget  # the last step crossed the budget with drafts accepted

    expected = _hf_greedy(model, prompt, 30, [])
    stop = expected[5]
    stopped = generate(model, oracle, [prompt], GREEDY, 30, [stop])[0]
    assert stopped.finished_by == "stop"
    assert sum(s.new_tokens for s in stopped.steps) + 1 == len(stopped.tokens)  # trimmed just after the stop token
    assert step_tokens([4, 9, 2, 9], {9}) == 2 and step_tokens([4, 5], {9}) == 2


def test_draft_below_pauses_drafting_while_the_batch_is_large_and_resumes_with_whole_context(forward_target):
    model, tok = forward_target.model, forward_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("hi", "a long prompt about numbers 1 2 3 4", "math: 12*7=")]
    budgets = [6, 40, 40]  # sequence 0 finishes first, so the batch shrinks from 3 to 2
    expected = [_hf_greedy(model, p, n, []) for p, n in zip(prompts, budgets)]
    oracle = Recording(GreedyOracle(model, first_token=bos, depth=4))

    batch = TargetBatch(model)
    generations = run_loop(batch, oracle, prompts, GREEDY, budgets, [], draft_below=3)
    assert [g.tokens for g in generations] == expected
    assert batch.live == [1, 2] and batch.batch_size == 2  # the finished sequence left the cache
    paused = len(generations[0].steps)  # steps while all three were unfinished
    assert paused == 5  # one token per undrafted step after the prefill's
    for b, generation in enumerate(generations[1:], start=1):
        before, after = generation.steps[:paused], generation.steps[paused:]
        assert all(s.tree_size == 1 and s.head == NOT_DRAFTED and s.accepted == 0 for s in before)
        assert all(s.tree_size > 1 and s.head == 0 for s in after)
        assert max(s.accepted for s in after) == 4  # the oracle's full chains are accepted again
        # the proposer saw every position without a gap: the paused steps' tokens reached it on resuming
        context = prompts[b][1:] + generation.tokens
        assert oracle.seen[b] == context[: len(oracle.seen[b])]
        assert len(oracle.seen[b]) >= len(prompts[b]) - 1 + paused + 1

    never = run_loop(TargetBatch(model), oracle, prompts[1:2], GREEDY, 12, [], draft_below=1)[0]
    assert never.tokens == expected[1][:12] and {s.tree_size for s in never.steps} == {1}
    with pytest.raises(ValueError, match="draft_below must be at least 1"):
        run_loop(TargetBatch(model), oracle, prompts[:1], GREEDY, 4, [], draft_below=0)
    with pytest.raises(ValueError, match="one per prompt"):
        run_loop(TargetBatch(model), oracle, prompts, GREEDY, [4, 4], [])
    with pytest.raises(ValueError, match="2 proposers for 3 prompts"):
        run_loop(TargetBatch(model), [oracle, oracle], prompts, GREEDY, 4, [])


def test_finished_sequences_leave_the_batch_and_sampling_follows_each_seed(device_target):
    model, tok = device_target.model, device_target.tokenizer
    prompts = [tok.encode(t) for t in ("short one", "a longer prompt that keeps going", "third")]
    params = SamplingParams(temperature=1.0)
    batch = TargetBatch(model)
    together = run_loop(batch, PlainDecoding(), prompts, params, [2, 14, 6], [], seeds=[5, 6, 7])
    assert [len(g.tokens) for g in together] == [2, 14, 6] and batch.live == [1] and batch.batch_size == 1
    for prompt, seed, n, generation in zip(prompts, (5, 6, 7), (2, 14, 6), together):
        alone = run_loop(TargetBatch(model), PlainDecoding(), [prompt], params, n, [], seeds=[seed])[0]
        assert generation.tokens == alone.tokens  # each row kept its own generator as others left


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sampled_speculative_decoding_commits_the_tokens_plain_sampling_does(small_vocab_target, params):
    """Every committed token is a draw from the target's distribution at its position with that position's
    uniform, whatever the tree: with the same seeds, speculative and plain sampling commit the same tokens (up
    to fp32 rounding landing a uniform across a cumulative-probability boundary, ~1e-7 per token). Sequence by
    sequence, this is the T > 0 lossless check a distribution test cannot give; drafts were accepted."""
    model = small_vocab_target.model
    prompts = [[1, 2, 3], [4, 0], [2, 2, 1, 3]] * 4
    seeds = list(range(100, 100 + len(prompts)))
    drafted = run_loop(TargetBatch(model), DUPLICATE_TREE, prompts, params, 12, [], seeds=seeds)
    plain = run_loop(TargetBatch(model), PlainDecoding(), prompts, params, 12, [], seeds=seeds)
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]
    assert sum(s.accepted for g in drafted for s in g.steps) > 10
    assert len({tuple(g.tokens) for g in plain}) > 3  # the seeds drew different continuations


def test_results_own_their_storage_so_one_sequence_pickles_to_a_quarter_of_the_batch(tiny_target):
    """A drafter is shipped its own sequence's rows, never the batch's hidden states or logits behind a view."""
    prompts = [list(range(100 + 48 * b, 148 + 48 * b)) for b in range(4)]  # equal lengths: equal shares
    batch = TargetBatch(tiny_target.model, keep_logits=True)
    started = batch.start(prompts, GREEDY, [0, 1, 2, 3])
    trees = [build_tree(torch.tensor([int(c.next_tokens[-1]), 5, 6]), torch.tensor([-1, 0, 1])) for c in started]
    stepped = batch.step(trees)
    for results in (started, stepped):
        for c in results:
            for tensor in (c.features, c.next_tokens, c.logits):
                assert tensor.untyped_storage().nbytes() == tensor.nbytes  # owns exactly its own elements
        share = len(pickle.dumps(results[0])) / len(pickle.dumps(results))
        assert 0.22 < share < 0.28, share


@pytest.mark.slow
def test_greedy_lossless_on_smollm2_fp32(smollm2_fp32):
    target = smollm2_fp32
    tok = target.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for q in ("What is 15 + 27? Answer briefly.", "Name three colours.")
    ]
    oracle = GreedyOracle(target.model, first_token=prompts[0][0], depth=3)
    random_head = _random_head_proposer(target, TreeConfig(total_token=8, depth=3, top_k=3))
    for proposer in (oracle, random_head):
        generations = generate(target.model, proposer, prompts, GREEDY, 24, target.stop_token_ids)
        for prompt, generation in zip(prompts, generations):
            assert generation.tokens == _hf_greedy(target.model, prompt, 24, target.stop_token_ids)
        if proposer is oracle:
            assert sum(s.accepted for g in generations for s in g.steps) > 0


# --- lossless sampling ---------------------------------------------------------------------------------------


def _exact_pair_distribution(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(x2, x3) after the prompt, marginalised over x1, from the target's processed distributions."""
    vocab = model.config.vocab_size
    p1 = processed_probs(model(torch.tensor([prompt])).logits[0, -1], params)
    joint = torch.zeros(vocab, vocab)
    for x1 in range(vocab):
        p2 = processed_probs(model(torch.tensor([prompt + [x1]])).logits[0, -1], params)
        for x2 in range(vocab):
            p3 = processed_probs(model(torch.tensor([prompt + [x1, x2]])).logits[0, -1], params)
            joint[x2] += p1[x1] * p2[x2] * p3
    return joint


def _sampled_pairs(model, proposer, prompt, params, runs: int) -> torch.Tensor:
    counts = torch.zeros(model.config.vocab_size, model.config.vocab_size)
    for seed in range(runs):
        tokens = generate(model, proposer, [prompt], params, 3, [], seeds=[seed])[0].tokens
        counts[tokens[1], tokens[2]] += 1
    return counts


def _chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs.flatten() * counts.sum()
    keep = expected > 0
    return float(stats.chisquare(counts.flatten()[keep], expected[keep] * counts.sum() / expected[keep].sum()).pvalue)


# A tree with duplicate siblings (as a merged tree has) and depth 2 under the root.
DUPLICATE_TREE = FixedTree(tokens=[0, 1, 0, 2, 3, 1], parents=[0, 0, 0, 1, 1, 2])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sampling_is_lossless_chi_square(small_vocab_target, params):
    model = small_vocab_target.model
    prompt = [1, 2, 3]
    exact = _exact_pair_distribution(model, prompt, params)
    counts = _sampled_pairs(model, DUPLICATE_TREE, prompt, params, runs=1500)
    assert _chi_square_pvalue(counts, exact) > 1e-3


def test_chi_square_detects_a_broken_acceptance_rule(small_vocab_target, monkeypatch):
    """The distribution test has power: the target's choice after each node read from its parent's logits (an
    off-by-one) must fail it."""
    import taps_ray.decoding.verify as verify

    model = small_vocab_target.model
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0)
    original = verify.target_choices
    monkeypatch.setattr(verify, "target_choices", lambda logits, rows, uniforms: original(
        torch.cat([logits[:, :1], logits[:, :-1]], dim=1), rows, uniforms))
    counts = _sampled_pairs(model, DUPLICATE_TREE, prompt, params, runs=300)
    monkeypatch.undo()
    assert _chi_square_pvalue(counts, _exact_pair_distribution(model, prompt, params)) < 1e-6


def test_stochastic_acceptance_single_step_matches_target():
    """One tree, fixed logits, 4000 seeds verified as one batch: the committed first token is distributed exactly
    as the target says."""
    logits = torch.tensor([[1.0, 0.5, -0.5, 0.0], [0.2, 0.1, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0, 0, 0]])
    tree = build_tree(torch.tensor([0, 3, 0, 3]), torch.tensor([-1, 0, 0, 0]))  # duplicate sibling 3
    params = SamplingParams(temperature=1.0)
    runs = 4000
    uniforms = position_uniforms(torch.arange(runs), torch.arange(1, 5).expand(runs, -1))
    counts = torch.zeros(4)
    for verdict in POINT_MASS.verdicts([tree] * runs, logits.expand(runs, -1, -1), [params] * runs, uniforms):
        first = verdict.tokens[1] if verdict.accepted else verdict.bonus
        counts[first] += 1
    expected = processed_probs(logits[0], params) * runs
    assert stats.chisquare(counts, expected).pvalue > 1e-3


def test_greedy_acceptance_picks_longest_path_first_row_on_ties():
    vocab = 6
    tree = build_tree(torch.tensor([0, 1, 2, 3, 1]), torch.tensor([-1, 0, 1, 0, 0]))
    logits = torch.full((5, vocab), -5.0)
    logits[0, 1] = 5  # root -> 1
    logits[1, 2] = 5  # 1 -> 2
    logits[2, 4] = 5  # bonus after 2
    logits[4, 5] = 5
    (verdict,) = POINT_MASS.verdicts([tree], logits[None], [GREEDY])
    assert verdict.nodes == [0, 1, 2] and verdict.bonus == 4


class Counting(PointMass):
    """The engine's rule, counting the trees it decided from logits and from recorded greedy tokens."""

    def __init__(self) -> None:
        self.from_logits = self.from_greedy = 0

    def verdicts(self, trees, logits, params, uniforms=None):
        self.from_logits += sum(trees.present)
        return super().verdicts(trees, logits, params, uniforms)

    def greedy_verdicts(self, trees, target_next):
        self.from_greedy += sum(trees.present)
        return super().greedy_verdicts(trees, target_next)


def test_one_acceptance_rule_decides_live_decoding_and_replay(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("a long prompt about numbers 1 2 3 4", "math: 12*7=")]
    oracle = GreedyOracle(model, first_token=bos, depth=3)
    rule = Counting()
    live = run_loop(TargetBatch(model, acceptance=rule), oracle, prompts, GREEDY, 12, [])
    assert [g.tokens for g in live] == [g.tokens for g in generate(model, oracle, prompts, GREEDY, 12, [])]
    assert rule.from_logits == sum(len(g.steps) for g in live) and rule.from_greedy == 0

    traces = record_traces(lambda: TargetBatch(model), prompts, 12, [], lookahead=oracle.depth + 1)
    replayed = run_loop(TraceVerifier(traces, rule), oracle, prompts, GREEDY, 12, [])
    assert [g.tokens for g in replayed] == [g.tokens for g in live]
    assert [[s.accepted for s in g.steps] for g in replayed] == [[s.accepted for s in g.steps] for g in live]
    assert rule.from_greedy == sum(len(g.steps) for g in live)


def test_a_draft_probability_rides_on_the_tree_through_pruning_and_padding():
    tree = build_tree(torch.tensor([5, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]),
                      confidence=torch.tensor([0.9, 0.5, 0.8]), draft_prob=torch.tensor([0.9, 0.6, 0.8]))
    pruned = subtree(tree, [1, 3])
    assert pruned.draft_prob.tolist() == pytest.approx([0.9, 0.8])
    padded = pad_trees([pruned, None, tree], 5, "cpu")
    want = torch.tensor([[1, 0.9, 0.8, 1, 1], [1] * 5, [1, 0.9, 0.6, 0.8, 1]])
    torch.testing.assert_close(padded.draft_prob, want)
    assert pad_trees([tree, build_tree(torch.tensor([5]), torch.tensor([-1]))], 4, "cpu").draft_prob is None
    assert root_only(5, "cpu").draft_prob is None


def test_reduced_draft_vocabulary_drafts_only_its_ids_and_stays_lossless(device_target):
    from taps_ray.data.draft_vocab import frequent_tokens

    model, tok, device = device_target.model, device_target.tokenizer, device_target.device
    texts = ["The answer is 42.", "Let us add 3 and 4 to get 7.", "Hello! How can I help you today?"] * 3
    prompt = tok.encode("The answer is")
    expected = _hf_greedy(model, prompt, 20, device_target.stop_token_ids)
    # the target's own continuation is in the vocabulary, so a head fitted to it gets drafts accepted
    always = sorted({*device_target.stop_token_ids, *expected})
    vocab = frequent_tokens(tok, texts, size=len(always) + 20, always=always)  # on the CPU, as stored
    assert vocab.numel() == len(always) + 20 and set(always) <= set(vocab.tolist())
    head = fit_head(device_target, [prompt + expected])
    context = DraftContext(model.get_input_embeddings(), model.lm_head, vocab)
    proposer = SingleHead("reduced", head, context, TreeConfig(total_token=8, depth=3, top_k=3))
    features = model.model(torch.tensor([prompt], device=device)).last_hidden_state[0]
    tree, _ = proposer.propose(HeadCache(), features, torch.tensor(prompt[1:] + [5], device=device))
    assert tree.tokens.device.type == device.type
    assert set(tree.tokens[1:].tolist()) <= set(vocab.tolist())
    generation = generate(model, proposer, [prompt], GREEDY, 20, device_target.stop_token_ids)[0]
    assert generation.tokens == expected
    assert sum(s.accepted for s in generation.steps) > 0


def test_a_head_drafting_in_bf16_under_an_fp32_target_stays_lossless_and_gets_drafts_accepted(device_target):
    """serve.draft_dtype: heads loaded in bfloat16 under an fp32 target draft through a bf16 copy of the LM head's
    draft-vocabulary rows; the target still verifies in fp32, so greedy output is its own, token for token."""
    from taps_ray.drafting.registry import build_proposer

    model, tok = device_target.model, device_target.tokenizer
    prompt = tok.encode("The answer is")
    expected = _hf_greedy(model, prompt, 20, device_target.stop_token_ids)
    vocab = torch.tensor(sorted({*device_target.stop_token_ids, *expected, *range(40)}))
    head = fit_head(device_target, [prompt + expected]).to(torch.bfloat16)
    tree = TreeConfig(total_token=8, depth=3, top_k=3)
    proposer = build_proposer("fitted", device_target, {"fitted": head}, tree, vocab)
    rows = proposer.context._projection.row_weight()
    assert rows.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    assert torch.equal(rows, model.lm_head.weight[vocab.to(rows.device)].to(torch.bfloat16))
    generation = generate(model, proposer, [prompt], GREEDY, 20, device_target.stop_token_ids)[0]
    assert generation.tokens == expected
    assert sum(s.accepted for s in generation.steps) > 0
    whole = build_proposer("fitted", device_target, {"fitted": head}, tree)  # the full vocabulary, cast too
    assert whole.context._projection.row_weight().dtype == torch.bfloat16
    assert generate(model, whole, [prompt], GREEDY, 20, device_target.stop_token_ids)[0].tokens == expected
    with pytest.raises(ValueError, match="one dtype"):
        build_proposer("merged", device_target, {"fitted": head, "other": fit_head(device_target, [prompt])}, tree)


def test_draft_dtype_auto_halves_only_an_fp32_target_on_a_cpu_that_multiplies_bf16_natively(monkeypatch):
    from types import SimpleNamespace

    import taps_ray.drafting.setup as setup

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fp32_cpu, bf16_cpu, fp32_gpu = (SimpleNamespace(dtype=d, device=v) for d, v in
                                    ((torch.float32, cpu), (torch.bfloat16, cpu), (torch.float32, cuda)))
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(setup, "native_bf16", lambda native=native: native)
        assert setup.draft_dtype("auto", fp32_cpu) == want
        assert setup.draft_dtype("auto", bf16_cpu) == torch.bfloat16
        assert setup.draft_dtype("auto", fp32_gpu) == torch.float32
    assert setup.draft_dtype(None, fp32_cpu) == torch.float32  # unset: the target's
    assert setup.draft_dtype("bfloat16", fp32_gpu) == torch.bfloat16


def test_sampling_with_a_bf16_head_under_an_fp32_target_is_lossless_chi_square(small_vocab_target):
    """At T > 0 the draft probabilities a bf16 head proposes with are the ones verification corrects by: the
    committed tokens keep the target's distribution."""
    from taps_ray.drafting.registry import build_proposer

    model = small_vocab_target.model
    head = new_head(model.config, seed=1).to(torch.bfloat16)
    proposer = build_proposer("random", small_vocab_target, {"random": head}, TreeConfig(total_token=4, depth=2,
                                                                                         top_k=2))
    params, prompt = SamplingParams(temperature=1.0), [1, 2, 3]
    counts = _sampled_pairs(model, proposer, prompt, params, runs=600)
    accepted = sum(s.accepted for seed in range(20) for s in
                   generate(model, proposer, [prompt], params, 3, [], seeds=[seed])[0].steps)
    assert accepted > 0
    assert _chi_square_pvalue(counts, _exact_pair_distribution(model, prompt, params)) > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=5e-324)])
def test_processed_probs_stay_finite_at_extreme_settings(params):
    probs = processed_probs(torch.tensor([2.0, 1.0, 0.5, -1.0]), params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5 and int(probs.argmax()) == 0


def test_without_seeds_each_call_draws_fresh_seeds_and_reports_them(small_vocab_target):
    """No silent default: two calls without seeds at T > 0 draw differently (the old default, seed b for row b,
    repeated itself), and the seeds each generation reports repeat its run token for token."""
    model = small_vocab_target.model
    prompts = [[1, 2, 3], [4, 0, 2]]
    params = SamplingParams(temperature=1.0)
    first = run_loop(TargetBatch(model), DUPLICATE_TREE, prompts, params, 16, [])
    second = run_loop(TargetBatch(model), DUPLICATE_TREE, prompts, params, 16, [])
    assert [g.seed for g in first] != [g.seed for g in second] and len({g.seed for g in first}) == 2
    assert [g.tokens for g in first] != [g.tokens for g in second]
    again = run_loop(TargetBatch(model), DUPLICATE_TREE, prompts, params, 16, [], seeds=[g.seed for g in first])
    assert [g.tokens for g in again] == [g.tokens for g in first]
    assert [g.seed for g in again] == [g.seed for g in first]
    assert sum(s.accepted for g in first for s in g.steps) > 0
