"""The fast forward's compiled path (`target.compile: inductor`) decodes exactly as the eager forward does.

The layer graph fuses the norms, RoPE and the MLP's glue, so its fp32 logits round differently from eager's
(tests/test_fast_forward.py holds both to the same float64 bound); tokens are what must not change: greedy
decoding gives the target's greedy chain token for token, and sampling with the same seeds the same tokens
(a sampled token could only differ where a uniform draw falls within an fp32 rounding of a boundary between two
tokens' cumulative probabilities, about 1e-6 per token here). The tiny target compiles in seconds.
"""

from __future__ import annotations

import copy
import logging
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

from taps_ray.decoding.generate import run_loop
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposers import PlainDecoding
from taps_ray.drafting.tree import root_only
from taps_ray.models import layer_graph
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.hf_forward import HFForward
from taps_ray.models.target import Target, load_target
from taps_ray.models.target_forward import compile_unavailable_reason, target_forward

from oracles import GreedyOracle

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(compile_unavailable_reason(CPU) is not None,
                                reason=str(compile_unavailable_reason(CPU)))


@pytest.fixture(scope="module")
def compiled_target(tiny_config) -> Target:
    target = load_target(tiny_config.target.model_copy(update={"compile": "inductor"}))
    assert target_forward(target.model).compiled
    return target


@pytest.fixture(scope="module")
def prompts(tiny_target) -> list[list[int]]:
    tok = tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    return [[bos] + tok.encode(text) for text in ("hi there", "a longer prompt about numbers 1 2 3 4 5")]


def _decode(target: Target, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
            plain: bool = False) -> list:
    """Drafted by the oracle (trees: through the layer graph's row, packed side by side at 2+ rows), or `plain`
    (one-token steps)."""
    proposer = PlainDecoding() if plain else GreedyOracle(target.model, first_token=prompts[0][0], depth=4)
    return run_loop(TargetBatch(target.model), proposer, prompts, params, [24, 32], [], seeds=seeds)


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_compiled_greedy_decoding_is_eager_and_transformers_greedy(tiny_target, compiled_target, prompts):
    assert not target_forward(tiny_target.model).compiled
    compiled = _decode(compiled_target, prompts, SamplingParams(), [0, 1])
    eager = _decode(tiny_target, prompts, SamplingParams(), [0, 1])
    plain = _decode(compiled_target, prompts, SamplingParams(), [0, 1], plain=True)
    for prompt, got, want, one, n in zip(prompts, compiled, eager, plain, (24, 32), strict=True):
        assert got.tokens == want.tokens == one.tokens == _hf_greedy(tiny_target.model, prompt, n)
        assert max(step.accepted for step in got.steps) == 4  # the oracle's drafts were accepted, whole chains too
    # dynamic shapes: other prompt lengths, a growing cache and one row leaving the batch compile nothing new
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    longer = [prompts[1] + prompts[0][1:], prompts[0] + prompts[0][1:]]
    assert [g.tokens for g in _decode(compiled_target, longer, SamplingParams(), [0, 1], plain=True)] == \
        [g.tokens for g in _decode(tiny_target, longer, SamplingParams(), [0, 1], plain=True)]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("as_row", [True, False])
def test_a_batch_1_step_decodes_greedy_as_a_row_or_in_its_own_graph(tiny_target, compiled_target, prompts,
                                                                      monkeypatch, as_row):
    """`LayerGraph.one_token_as_row` picks, by CPU and dtype, how a batch-1 one-token step runs; both ways give the
    target's greedy tokens, and the row way runs the step at width 2."""
    graph = target_forward(compiled_target.model).graph
    monkeypatch.setattr(type(graph), "one_token_as_row", lambda self: as_row)
    compiled, widths = graph._compiled, []

    def spy(input_ids, *rest):
        widths.append(tuple(input_ids.shape))
        return compiled(input_ids, *rest)

    monkeypatch.setattr(graph, "_compiled", spy)
    (alone,) = run_loop(TargetBatch(compiled_target.model), PlainDecoding(), prompts[:1], SamplingParams(), 24, [],
                        seeds=[0])
    assert alone.tokens == _hf_greedy(tiny_target.model, prompts[0], 24)
    steps = widths[1:]  # after the prefill
    assert len(steps) == 23 and set(steps) == {(1, 2) if as_row else (1, 1)}


def test_a_prompt_prefills_through_the_graph_padded_as_unpadded(compiled_target, prompts, monkeypatch):
    """One prompt's prefill runs through the layer graph at its length rounded up (`LayerGraph.prefill_width`): its
    features, last logits and cache are exactly those of the same prefill unpadded (fp32), and every length runs
    in one graph."""
    graph = target_forward(compiled_target.model).graph
    compiled, widths = graph._compiled, []

    def spy(input_ids, *rest):
        widths.append(input_ids.shape[1])
        return compiled(input_ids, *rest)

    def prefilled(prompt: list[int]) -> tuple:
        batch = TargetBatch(compiled_target.model)
        (out,) = batch.prefill([prompt])
        keys, values = batch.cache.layer(0)
        return out, keys[..., : batch.cache.width, :], values[..., : batch.cache.width, :], batch.cache.width

    prompt = prompts[1] + prompts[0][1:]
    lengths = [2, 7, 16, len(prompt)]
    TargetBatch(compiled_target.model).prefill([prompt[:3]])  # the graph of a prefill, compiled before counting
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(graph, "_compiled", spy)
    padded = [prefilled(prompt[:n]) for n in lengths]
    assert widths == [2, 8, 16, 16 * -(-len(prompt) // 16)]  # powers of two up to 16, then multiples of 16
    assert counters["stats"]["unique_graphs"] == graphs
    monkeypatch.setattr(layer_graph, "PREFILL_BUCKET", 1)
    widths.clear()
    unpadded = [prefilled(prompt[:n]) for n in lengths]
    assert widths == lengths and len(prompt) % 16 != 0
    for n, (out, keys, values, width), (alone, alone_keys, alone_values, alone_width) in zip(
            lengths, padded, unpadded, strict=True):
        assert width == alone_width == n and out.hidden.shape[0] == n
        assert torch.equal(out.hidden, alone.hidden) and torch.equal(out.logits, alone.logits)
        assert torch.equal(keys, alone_keys) and torch.equal(values, alone_values)


def test_compiled_sampling_follows_the_seeds_as_eager_does(tiny_target, compiled_target, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    compiled = _decode(compiled_target, prompts, params, [3, 7])
    eager = _decode(tiny_target, prompts, params, [3, 7])
    assert [g.tokens for g in compiled] == [g.tokens for g in eager]
    assert [g.tokens for g in _decode(compiled_target, prompts, params, [3, 7], plain=True)] == \
        [g.tokens for g in _decode(tiny_target, prompts, params, [3, 7], plain=True)]
    assert sum(step.accepted for g in compiled for step in g.steps) > 0
    other_seeds = _decode(compiled_target, prompts, params, [4, 8])
    assert [g.tokens for g in other_seeds] != [g.tokens for g in compiled]  # the seeds do choose the tokens


def test_a_copy_of_a_compiled_forward_computes_with_its_own_weights(tiny_config, prompts):
    """The compiled graphs are bound to their forward: a deep copy or unpickled copy of the model compiles its
    own, so a change to the original's weights does not reach the copies (were the original's bound graphs
    copied along, the copies would compute with the original's layers)."""
    model = load_target(tiny_config.target.model_copy(update={"compile": "inductor"})).model

    def logits(of: torch.nn.Module) -> torch.Tensor:  # of a one-token step, which runs the layer graph
        batch = TargetBatch(of)
        batch.prefill(prompts[:1])
        return batch.forward_trees([root_only(prompts[0][-1], "cpu")])[0]

    before = logits(model)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for copied in copies:
        assert target_forward(copied).compiled and target_forward(copied) is not target_forward(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    assert not torch.allclose(logits(model), before, rtol=1e-2, atol=1e-2)
    for copied in copies:
        torch.testing.assert_close(logits(copied), before, rtol=0, atol=0)


def test_compile_falls_back_to_eager_with_a_line_naming_the_fix(tiny_config, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="taps_ray.models.target_forward")
    hf = load_target(tiny_config.target.model_copy(update={"compile": "inductor", "forward": "hf"}))
    assert isinstance(target_forward(hf.model), HFForward)
    assert "compiles taps' fast forward only" in caplog.text
    caplog.clear()
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("taps-no-such-compiler",))
    assert "apt-get install g++" in compile_unavailable_reason(CPU)
    eager = load_target(tiny_config.target.model_copy(update={"compile": "inductor"}))
    forward = target_forward(eager.model)
    assert isinstance(forward, FastLlama) and not forward.compiled
    assert "cannot run" in caplog.text and "apt-get install g++" in caplog.text


def test_a_replica_warm_up_compiles_what_plain_serving_runs(tiny_config, tiny_target, prompts):
    """serve/warm_up.py: after it, plain steps at any batch, prefills and trees compile nothing new,
    and the compiled forward decodes eager's greedy tokens under the replica's batcher and under drafting."""
    from taps_ray.decoding.continuous import ContinuousBatcher, Request
    from taps_ray.serve.warm_up import warm_up

    target = load_target(tiny_config.target.model_copy(update={"compile": "inductor"}))

    def served(model: torch.nn.Module, batcher: ContinuousBatcher | None = None) -> list[list[int]]:
        batcher = batcher or ContinuousBatcher(model, [], 4)
        results: list = []
        for prompt in [*prompts, prompts[1][:5]]:
            batcher.submit(Request(prompt=prompt, proposer=PlainDecoding(), params=SamplingParams(), max_tokens=12,
                                   seed=0, ignore_eos=True), on_done=results.append)
        while batcher.busy:
            batcher.step()
        return sorted(r.generation.tokens for r in results)

    # the replica's prefill budget, here one prompt a step: the warm-up's two requests cannot start together
    batcher = ContinuousBatcher(target.model, [], 4, prefill_tokens=len(prompts[1]))
    warm_up(batcher, PlainDecoding(), prompts[1])
    graphs = counters["stats"]["unique_graphs"]
    assert served(target.model, batcher) == served(tiny_target.model)
    drafted = _decode(target, prompts, SamplingParams(), [0, 1])  # trees of two rows, then of one
    assert [g.tokens for g in drafted] == [g.tokens for g in _decode(tiny_target, prompts, SamplingParams(), [0, 1])]
    assert max(step.accepted for g in drafted for step in g.steps) == 4
    assert counters["stats"]["unique_graphs"] == graphs


# --- the captured step (target.compile: step) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def step_target(tiny_config) -> Target:
    target = load_target(tiny_config.target.model_copy(update={"compile": "step"}))
    assert target_forward(target.model).captured == "compile"
    return target


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _oracle_decode(target: Target, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                   batch: TargetBatch | None = None) -> list:
    """Every prompt to the same budget: the oracle accepts alike in every row, so the batch never shrinks (a
    smaller batch would be another bucket)."""
    oracle = GreedyOracle(target.model, first_token=prompts[0][0], depth=4)
    return run_loop(batch or TargetBatch(target.model), oracle, prompts, params, 20, [], seeds=seeds)


def _four_prompts(prompts: list[list[int]]) -> list[list[int]]:
    return [*prompts, prompts[1] + prompts[0][1:], prompts[0] + prompts[1][1:]]


def test_captured_step_decodes_as_eager_in_one_graph_per_bucket(tiny_target, step_target, prompts):
    """Greedy through the captured step is eager's tokens, with drafts accepted; the whole step is one graph
    (fullgraph: a graph break would raise), and batches of 3 and 4 sequences (one bucket) with other prompt
    lengths and a growing cache compile it once."""
    breaks, graphs = _breaks(), counters["stats"]["unique_graphs"]
    three = _four_prompts(prompts)[:3]
    got = _oracle_decode(step_target, three, SamplingParams(), [0, 1, 2])
    assert [g.tokens for g in got] == [g.tokens for g in _oracle_decode(tiny_target, three, SamplingParams(),
                                                                        [0, 1, 2])]
    assert max(step.accepted for g in got for step in g.steps) == 4
    assert counters["stats"]["unique_graphs"] == graphs + 1
    four = _four_prompts(prompts)
    got = _oracle_decode(step_target, four, SamplingParams(), [0, 1, 2, 3])
    assert [g.tokens for g in got] == [g.tokens for g in _oracle_decode(tiny_target, four, SamplingParams(),
                                                                        [0, 1, 2, 3])]
    assert counters["stats"]["unique_graphs"] == graphs + 1  # batch 4: the same bucket, no recompile
    assert _breaks() == breaks


def test_captured_step_samples_as_eager_with_the_same_seeds(tiny_target, step_target, prompts):
    """Temperature only: top-p's sort over the vocabulary doubles the compile time; the chi-square test below
    samples with top-p through the same function."""
    params = SamplingParams(temperature=0.8)
    four = _four_prompts(prompts)
    got = _oracle_decode(step_target, four, params, [3, 7, 5, 9])
    assert [g.tokens for g in got] == [g.tokens for g in _oracle_decode(tiny_target, four, params, [3, 7, 5, 9])]
    assert sum(step.accepted for g in got for step in g.steps) > 0


def test_captured_step_logits_are_within_the_float64_bound(tiny_config, step_target, prompts):
    """The logits a captured step keeps (`keep_logits`) are as close to the float64 model's as transformers' own
    fp32 forward is (the bound of tests/test_fast_forward.py), at every committed token of a few steps."""
    exact = copy.deepcopy(step_target.model).double()
    batch = TargetBatch(step_target.model, keep_logits=True)
    oracle = GreedyOracle(step_target.model, first_token=prompts[0][0], depth=4)
    committed = batch.start(prompts, SamplingParams(), [0, 1])
    states = [oracle.init_state() for _ in prompts]
    tokens = [list(p) for p in prompts]
    for _ in range(3):
        trees = []
        for b, c in enumerate(committed):
            tree, states[b] = oracle.propose(states[b], c.features, c.next_tokens)
            tokens[b] += c.tokens
            trees.append(tree)
        committed = batch.step(trees)
        for b, c in enumerate(committed):
            sequence = torch.tensor([tokens[b] + c.tokens[:-1]])  # the root, then the accepted drafts
            n = len(c.tokens)
            truth = exact(sequence).logits[0, -n:]
            hf_error = (step_target.model(sequence).logits[0, -n:].double() - truth).abs().max().item()
            bound = 8 * max(hf_error, torch.finfo(torch.float32).eps * truth.abs().max().item())
            assert (c.logits.double() - truth).abs().max().item() <= bound
    assert sum(len(c.tokens) - 1 for c in committed) > 0  # the last step accepted drafts: paths, not roots only


@pytest.mark.parametrize("small_vocab_target", ["fast"], indirect=True)
def test_the_captured_step_function_is_lossless(tiny_variants, small_vocab_target, monkeypatch):
    """The lossless tests of tests/test_engine.py on the captured step's function, run uncompiled (`captured:
    eager`; the graph computes its tokens, as the tests above hold): greedy decoding of the oracle's trees is
    transformers' greedy output, batched and alone, and sampling from a tree with duplicate siblings has the
    target's joint distribution (chi-square)."""
    import test_engine

    for target in (tiny_variants("cpu", "fast"), small_vocab_target):
        monkeypatch.setattr(target_forward(target.model), "captured", "eager")
    test_engine.test_greedy_oracle_accepts_and_stays_lossless_batch_and_alone(tiny_variants("cpu", "fast"))
    test_engine.test_sampling_is_lossless_chi_square(small_vocab_target, SamplingParams(temperature=0.7, top_p=0.9))


def test_a_captured_step_launches_a_few_ops_whatever_the_batch(tiny_target):
    """What the host launches around the captured step (benchmarks/speed/step_ops.py counts it; the graph is one
    launch): the trees packed in a fixed number of ops, one read, a copy of each row's results; at batch 16 with
    the paper's tree within the goal of 150 (issue #42), and nothing else that grows with the batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from step_ops import PAPER_TREE, count_step

    one, sixteen = (count_step(tiny_target.model, "eager", batch, PAPER_TREE[0], context=16) for batch in (1, 16))
    assert one["graphs"] == sixteen["graphs"] == 1
    assert sixteen["launched"] <= 150
    assert sixteen["launched"] - one["launched"] <= 4 * 15  # per extra row: its features, tokens and one padding op
    assert target_forward(tiny_target.model).captured is None
