"""Continuous batching (taps_ray.decoding.continuous): requests join and leave the running batch between steps.

Exactness is the point: whatever joins or leaves, and whichever proposer or sampling parameters its
neighbours use, a sequence's tokens are what it would decode alone (T=0: the target's greedy chain).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from taps_ray.decoding.continuous import ContinuousBatcher, Request, Result, length_groups
from taps_ray.decoding.draft_gate import DraftGate
from taps_ray.decoding.generate import run_loop
from taps_ray.drafting.proposer import NOT_DRAFTED
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposers import PlainDecoding
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.target_forward import target_forward

from oracles import GreedyOracle

GREEDY = SamplingParams()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _submit(batcher: ContinuousBatcher, results: dict, key, prompt, proposer, n, params=GREEDY, seed=0,
            on_tokens=None, **extra) -> Callable[[], None]:
    """Submit a request whose result lands in `results[key]`; returns its cancel function."""
    def done(result: Result) -> None:
        results[key] = result

    request = Request(prompt=prompt, proposer=proposer, params=params, max_tokens=n, seed=seed, **extra)
    return batcher.submit(request, on_tokens=on_tokens, on_done=done)


def _drain(batcher: ContinuousBatcher, limit: int = 500) -> list[int]:
    """Step until idle; returns the live batch size after each step."""
    sizes = []
    while batcher.busy and len(sizes) < limit:
        batcher.step()
        sizes.append(batcher.live)
    assert not batcher.busy
    return sizes


@pytest.fixture(scope="module")
def setup(forward_target):
    model, tok = forward_target.model, forward_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("hi there", "a long prompt about numbers 1 2 3 4", "math: 12*7=", "x")]
    return model, bos, prompts


def test_requests_joining_mid_batch_decode_exactly_with_mixed_proposers(setup):
    model, bos, prompts = setup
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=3)
    results: dict = {}
    budgets = [20, 30, 12, 16]
    proposers = [oracle, PlainDecoding(), oracle, oracle]
    _submit(batcher, results, 0, prompts[0], proposers[0], budgets[0])
    _submit(batcher, results, 1, prompts[1], proposers[1], budgets[1])
    for _ in range(3):
        batcher.step()
    assert batcher.live == 2
    _submit(batcher, results, 2, prompts[2], proposers[2], budgets[2])  # joins a running batch
    _submit(batcher, results, 3, prompts[3], proposers[3], budgets[3])  # waits: max_batch_size=3
    batcher.step()
    assert batcher.live == 3 and batcher.waiting == 1
    sizes = _drain(batcher)
    assert max(sizes) == 3 and sizes[-1] == 0
    for i, prompt in enumerate(prompts):
        result = results[i]
        assert result.error is None and result.generation.finished_by == "length"
        assert result.generation.tokens == _hf_greedy(model, prompt, budgets[i]), i
    for i in (0, 2, 3):  # the oracle's drafts were accepted inside the shared batch
        assert max(s.accepted for s in results[i].generation.steps) == 4
        # Serve's default: no per-node diagnostics read back, the step counts kept
        assert all(s.node_confidence == s.node_entropy == s.node_source == s.node_accepted == []
                   for s in results[i].generation.steps)
    assert all(s.tree_size == 1 for s in results[1].generation.steps)
    assert results[2].max_batch == 3 and results[3].max_batch >= 2 and results[0].max_batch == 3


def test_requests_joining_a_running_batch_are_prefilled_inside_its_step(setup, monkeypatch):
    """With taps' fast forward, joining requests ride along the running batch's step (one forward: no prefill of
    their own, no stall for the running rows); with transformers' they are prefilled first. Either way every
    sequence decodes what it would alone: greedy ones the target's greedy tokens, a sampled one its seed's."""
    model, bos, prompts = setup
    calls: dict[str, list[int]] = {"start": [], "step_joining": []}
    for name in calls:
        original = getattr(TargetBatch, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            prompts_arg = args[0] if _name == "start" else args[2]
            calls[_name].append(len(prompts_arg))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TargetBatch, name, spy)
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    sampled = SamplingParams(temperature=0.8, top_p=0.9)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4)
    results: dict = {}
    _submit(batcher, results, "running", prompts[1], oracle, 24)
    batcher.step()
    _submit(batcher, results, "greedy", prompts[0], PlainDecoding(), 10)
    _submit(batcher, results, "sampled", prompts[2], oracle, 10, params=sampled, seed=7)
    batcher.step()
    assert batcher.live == 3 and batcher.waiting == 0
    _drain(batcher)
    fast = isinstance(target_forward(model), FastLlama)
    assert calls == ({"start": [1], "step_joining": [2]} if fast else {"start": [1, 1, 1], "step_joining": []})  # hf: by length
    assert results["running"].generation.tokens == _hf_greedy(model, prompts[1], 24)
    assert results["greedy"].generation.tokens == _hf_greedy(model, prompts[0], 10)
    assert max(s.accepted for s in results["running"].generation.steps) == 4  # drafts accepted in the shared steps
    alone = ContinuousBatcher(model, stop_ids=[], max_batch_size=1)
    _submit(alone, results, "sampled alone", prompts[2], oracle, 10, params=sampled, seed=7)
    _drain(alone)
    assert results["sampled"].generation.tokens == results["sampled alone"].generation.tokens


def test_draft_below_decides_per_step_from_the_live_batch(setup):
    model, bos, prompts = setup
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4, gate=DraftGate(2), node_stats=True)
    results: dict = {}
    _submit(batcher, results, "short", prompts[0], oracle, 5)
    _submit(batcher, results, "long", prompts[1], oracle, 30)
    torch.manual_seed(0)  # the oracle's confidences
    _drain(batcher)
    long = results["long"].generation
    assert long.tokens == _hf_greedy(model, prompts[1], 30)
    heads = [s.head for s in long.steps]
    paused = len(results["short"].generation.steps)
    assert heads[:paused] == [NOT_DRAFTED] * paused  # two live sequences: plain steps
    assert set(heads[paused:]) == {0} and max(s.accepted for s in long.steps[paused:]) == 4  # alone: drafting
    # the paused-drafting rule is the loop's own (one decode step): run_loop pauses and resumes at the same steps,
    # drafts the same trees and records the same steps (Serve counts a step's tokens cut at the budget)
    torch.manual_seed(0)
    loop = run_loop(TargetBatch(model), oracle, prompts[:2], GREEDY, [5, 30], [], draft_below=2)
    for key, generation in zip(("short", "long"), loop):
        served = results[key].generation
        assert served.tokens == generation.tokens and len(served.steps) == len(generation.steps)
        for a, b in zip(served.steps, generation.steps):
            assert (a.accepted, a.tree_size, a.head, a.node_accepted, a.node_confidence) == (
                b.accepted, b.tree_size, b.head, b.node_accepted, b.node_confidence)
            assert a.new_tokens <= b.new_tokens
    assert any(s.node_accepted for s in results["long"].generation.steps)  # asked for: recorded as the loop does


def test_the_measured_gate_keeps_the_batch_exact_and_learns_from_every_step(setup):
    """Serve's default gate: a batch runs drafted and undrafted warm-up steps in turn, then whichever measured
    faster at its size (probing the other); output stays greedy and the drafted steps accepted drafts."""
    model, bos, prompts = setup
    oracle = GreedyOracle(model, first_token=bos, depth=4)
    gate = DraftGate(measured=True, warmup=2, probe_every=4)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4, gate=gate)
    results: dict = {}
    budgets = [40, 36, 8]
    for key, (prompt, budget) in enumerate(zip(prompts, budgets)):
        _submit(batcher, results, key, prompt, oracle, budget)
    _drain(batcher)
    for key, budget in enumerate(budgets):
        generation = results[key].generation
        assert generation.tokens == _hf_greedy(model, prompts[key], budget), key
    steps = results[0].generation.steps
    assert [s.head for s in steps[:2]] == [0, NOT_DRAFTED]  # warm-up: the two kinds in turn, drafted first
    assert max(s.accepted for s in steps if s.head == 0) == 4
    measured = {key for key, rate in gate.rates.items() if rate.steps >= 1}
    assert {(2, True), (2, False)} <= measured  # three live sequences: bucket 3-4, both kinds measured


class _PausedEverywhere(PlainDecoding):
    """A drafting model whose cost model has paused drafting on every sequence: root-only trees, no head."""

    name = "paused"
    drafts = True

    def head_of(self, state: None) -> int:
        return NOT_DRAFTED


def test_a_step_the_gate_lets_draft_counts_as_drafted_only_where_a_sequence_drafted(setup):
    """A step where every sequence verified its root only costs what an undrafted step does: the gate hears it as
    one, so the drafted kind's rate is only ever steps that drafted (at 16 in flight they cost several undrafted
    ones, and paused steps counted as drafted had made the two kinds look level)."""
    model, _, prompts = setup
    gate = DraftGate(measured=True, warmup=2, probe_every=4)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4, gate=gate)
    results: dict = {}
    for key in range(3):
        _submit(batcher, results, key, prompts[key], _PausedEverywhere(), 12)
    _drain(batcher)
    for key in range(3):
        assert results[key].generation.tokens == _hf_greedy(model, prompts[key], 12), key
    assert all(s.head == NOT_DRAFTED for s in results[0].generation.steps)
    assert gate.rates and all(not drafted for _, drafted in gate.rates)  # the gate let it draft; none did
    assert gate.rates[(2, False)].steps >= 8


def test_ignore_eos_decodes_past_the_stop_tokens_to_the_budget(setup):
    model, _, prompts = setup
    greedy = _hf_greedy(model, prompts[0], 8)
    batcher = ContinuousBatcher(model, stop_ids=[greedy[0]], max_batch_size=2)  # the first greedy token stops
    results: dict = {}
    _submit(batcher, results, "stops", prompts[0], PlainDecoding(), 8)
    _submit(batcher, results, "ignores", prompts[0], PlainDecoding(), 8, ignore_eos=True)
    _drain(batcher)
    assert results["stops"].generation.tokens == greedy[:1] and results["stops"].generation.finished_by == "stop"
    assert results["ignores"].generation.tokens == greedy and results["ignores"].generation.finished_by == "length"


def test_a_batch_of_plain_requests_teaches_the_gate_nothing(setup):
    model, _, prompts = setup
    gate = DraftGate(measured=True)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4, gate=gate)
    results: dict = {}
    _submit(batcher, results, 0, prompts[0], PlainDecoding(), 6)
    _drain(batcher)
    assert results[0].generation.tokens == _hf_greedy(model, prompts[0], 6) and gate.rates == {}


def test_sampling_parameters_are_per_sequence_and_follow_each_seed(setup):
    model, _, prompts = setup
    sampled = SamplingParams(temperature=0.8, top_k=50)
    alone = run_loop(TargetBatch(model), PlainDecoding(), [prompts[1]], sampled, 12, [], seeds=[11])[0].tokens
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4)
    results: dict = {}
    _submit(batcher, results, "greedy", prompts[0], PlainDecoding(), 10)
    batcher.step()
    _submit(batcher, results, "sampled", prompts[1], PlainDecoding(), 12, params=sampled, seed=11)
    _drain(batcher)
    assert results["sampled"].generation.tokens == alone
    assert results["greedy"].generation.tokens == _hf_greedy(model, prompts[0], 10)


def test_stop_condition_ends_decoding_at_the_step_that_completes_it(setup):
    model, bos, prompts = setup
    expected = _hf_greedy(model, prompts[2], 24)
    marker = expected[6]
    first = expected.index(marker)

    def stop(tokens: list[int], new: int) -> int | None:
        for k in range(len(tokens) - new, len(tokens)):
            if tokens[k] == marker:
                return k + 1
        return None

    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=2)
    results: dict = {}
    steps: list[list[int]] = []
    _submit(batcher, results, 0, prompts[2], GreedyOracle(model, first_token=bos), 24, stop=stop,
                            on_tokens=lambda tokens, _: steps.append(tokens))
    _drain(batcher)
    generation = results[0].generation
    assert generation.tokens == expected[: first + 1] and generation.finished_by == "stop"
    assert sum(steps, []) == generation.tokens  # streamed per step, nothing past the cut
    assert sum(s.new_tokens for s in generation.steps) + 1 == len(generation.tokens)


def test_logprobs_come_from_the_target_distribution(setup):
    model, bos, prompts = setup
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=2)
    results: dict = {}
    _submit(batcher, results, 0, prompts[0], GreedyOracle(model, first_token=bos), 8, top_logprobs=3)
    _submit(batcher, results, 1, prompts[1], PlainDecoding(), 4)
    _drain(batcher)
    tokens, logprobs = results[0].generation.tokens, results[0].logprobs
    assert [lp.token for lp in logprobs] == tokens and results[1].logprobs == []
    with torch.no_grad():
        full = model(torch.tensor([prompts[0] + tokens])).logits[0].float().log_softmax(-1)
    for i, lp in enumerate(logprobs):
        row = full[len(prompts[0]) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-3)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token  # greedy: the chosen token is the most likely
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_cancelled_and_failed_requests_end_cleanly(setup):
    model, _, prompts = setup
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=2)
    results: dict = {}
    _submit(batcher, results, "keep", prompts[0], PlainDecoding(), 10)
    cancel_gone = _submit(batcher, results, "gone", prompts[1], PlainDecoding(), 30)
    batcher.step()
    cancel_gone()
    _drain(batcher)
    assert results["gone"].generation.finished_by == "cancelled"
    assert results["keep"].generation.tokens == _hf_greedy(model, prompts[0], 10)
    _submit(batcher, results, "late", prompts[2], PlainDecoding(), 10)
    batcher.fail_all("shutting down")
    assert results["late"].error == "RuntimeError: shutting down" and not batcher.busy


def test_a_request_done_at_its_first_token_never_reaches_a_verification_step(setup):
    model, _, prompts = setup
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=2)
    results: dict = {}
    _submit(batcher, results, "one", prompts[0], PlainDecoding(), 1)
    _submit(batcher, results, "more", prompts[1], PlainDecoding(), 3)
    _drain(batcher)
    assert results["one"].generation.tokens == _hf_greedy(model, prompts[0], 1)
    assert results["one"].generation.steps == [] and len(results["more"].generation.steps) == 2
    assert results["more"].max_batch == 1  # the finished request left before the first step


def test_a_burst_joins_under_the_prefill_budget_in_length_groups(setup):
    """A burst of ragged prompts is admitted over several iterations (the running rows keep decoding between
    them), prefilled in groups of similar lengths, and every sequence still decodes the target's greedy tokens."""
    model, bos, prompts = setup
    ragged = [p * k for p, k in zip(prompts, (1, 3, 2, 6))]  # 3 to ~40 tokens
    budget = max(len(p) for p in ragged)
    batcher = ContinuousBatcher(model, stop_ids=[], max_batch_size=4, prefill_tokens=budget)
    results: dict = {}
    for i, prompt in enumerate(ragged):
        _submit(batcher, results, i, prompt, PlainDecoding(), 6)
    batcher.step()
    assert 1 <= batcher.live < 4 and batcher.waiting == 4 - batcher.live  # the budget held some back
    _drain(batcher)
    for i, prompt in enumerate(ragged):
        assert results[i].generation.tokens == _hf_greedy(model, prompt, 6), i
    assert max(r.max_batch for r in results.values()) >= 2

    class Seq:  # what length_groups reads of a sequence
        def __init__(self, n: int) -> None:
            self.request = type("R", (), {"prompt": [0] * n})()

    groups = length_groups([Seq(n) for n in (30, 300, 280, 35, 290, 5)])
    assert [[len(s.request.prompt) for s in g] for g in groups] == [[300, 290, 280], [35, 30], [5]]
    with pytest.raises(ValueError, match="prefill_tokens"):
        ContinuousBatcher(model, stop_ids=[], max_batch_size=2, prefill_tokens=0)
