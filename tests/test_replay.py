"""Replay at T = 0 (spec/replay.py): the same step records as the live loop, from one target decode per question."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from taps_ray.config import TreeConfig
from taps_ray.data.chat import build_prompt_ids
from taps_ray.data.sources import load_questions
from taps_ray.eval.runner import TraceCache, run_cell
from taps_ray.eval.cell import Cell
from taps_ray.report.build import evaluation_md
from taps_ray.report.data import ReportData
from taps_ray.engine.generate import generate, run_loop
from taps_ray.engine.proposers import PlainDecoding
from taps_ray.engine.registry import build_proposer, proposer_names
from taps_ray.engine.replay import record_traces, replay
from taps_ray.engine.target_batch import TargetBatch
from taps_ray.engine.verify import SamplingParams

from oracles import GreedyOracle, fit_head

GREEDY = SamplingParams()
MAX_NEW = 16


def _verifier(model):
    return lambda: TargetBatch(model)


def _fitted_heads(target, prompts: list[list[int]], max_new: int) -> dict:
    """math and chat heads fitted on the target's own continuations of different prompts (same start weights)."""
    plain = generate(target.model, PlainDecoding(), prompts, GREEDY, max_new + 6, [])
    sequences = [p + g.tokens for p, g in zip(prompts, plain)]
    half = len(sequences) // 2
    return {"math": fit_head(target, sequences[: half + 1], steps=30), "chat": fit_head(target, sequences[half:], steps=20)}


def compare(live: list, replayed: list) -> tuple[int, int]:
    """(turns whose accept counts differ, turns): a differing turn is a floating-point near-tie (see docs)."""
    differ = sum([s.accepted for s in a.steps] != [s.accepted for s in b.steps] for a, b in zip(live, replayed))
    return differ, len(live)


@pytest.fixture(scope="module")
def tiny_prompts(tiny_target) -> list[list[int]]:
    tok = tiny_target.tokenizer
    texts = ("Hello there, how are you", "2+2=", "a long prompt about numbers 1 2 3 4 5", "What is the capital")
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def tiny_heads(tiny_target, tiny_prompts) -> dict:
    return _fitted_heads(tiny_target, tiny_prompts, MAX_NEW)


def test_replay_equals_the_live_loop_for_every_proposer(tiny_config, tiny_target, tiny_prompts, tiny_heads):
    model, stops = tiny_target.model, tiny_target.stop_token_ids
    tree = tiny_config.tree
    traces = record_traces(_verifier(model), tiny_prompts, MAX_NEW, stops, lookahead=tree.depth + 1)
    for name in proposer_names(tiny_config):
        proposer = build_proposer(name, tiny_target, tiny_heads, tree)
        live = run_loop(TargetBatch(model), proposer, tiny_prompts, GREEDY, MAX_NEW, stops)
        replayed = replay(proposer, traces, MAX_NEW, stops)
        assert compare(live, replayed) == (0, len(tiny_prompts)), name  # fp32 on the tiny target: no near-tie
        for a, b in zip(live, replayed):
            assert b.tokens == a.tokens and b.finished_by == a.finished_by
            for x, y in zip(a.steps, b.steps):
                assert (y.new_tokens, y.tree_size, y.head, y.node_accepted) == (x.new_tokens, x.tree_size, x.head, x.node_accepted)
                assert y.node_confidence == pytest.approx(x.node_confidence, abs=1e-5)
                assert math.isnan(y.verify_s)
        if name != "plain":
            assert sum(s.accepted for g in replayed for s in g.steps) > 0, f"{name} accepted nothing: a vacuous test"


def test_replay_of_deep_oracle_trees_and_a_too_short_record(tiny_target, tiny_prompts):
    model = tiny_target.model
    bos = tiny_target.tokenizer.encode("<|im_start|>")[0]
    prompts = [[bos] + p for p in tiny_prompts]
    oracle = GreedyOracle(model, first_token=bos, depth=4)  # trees of depth 4: full chains every fifth step
    live = run_loop(TargetBatch(model), oracle, prompts, GREEDY, MAX_NEW, [])
    replayed = replay(oracle, record_traces(_verifier(model), prompts, MAX_NEW, [], lookahead=4), MAX_NEW, [])
    assert compare(live, replayed) == (0, len(prompts))
    assert max(s.accepted for g in replayed for s in g.steps) == 4
    short = record_traces(_verifier(model), prompts, 5, [], lookahead=0)  # the 5th step drafts 4 correct tokens
    with pytest.raises(ValueError, match="larger lookahead"):
        replay(oracle, short, 5, [])


def test_replayed_cells_equal_live_cells_and_share_one_decode(tiny_config, tiny_target):
    config = tiny_config.model_copy(
        update={"eval": tiny_config.eval.model_copy(update={"benchmarks": {"mt_bench": 2}, "max_new_tokens": 12})}
    )
    questions = load_questions("mt_bench", config.resolved_data_dir(), limit=2)
    first_turns = [build_prompt_ids(tiny_target.tokenizer, q.turns[:1], [], None) for q in questions]
    heads = _fitted_heads(tiny_target, first_turns, 12)  # so the cell's first turns get drafts accepted
    live_config = config.model_copy(update={"eval": config.eval.model_copy(update={"replay": False})})
    cache, verifiers = TraceCache(), []

    def counting(layers: tuple[int, ...]):
        verifiers.append(1)
        return TargetBatch(tiny_target.model, feature_layers=layers)

    columns = ["question_id", "turn", "tokens", "steps", "committed", "new_tokens"]
    for name in ("math", "merged"):
        cell = Cell("eagle2", name, "mt_bench", 0.0)
        live = pd.DataFrame(run_cell(live_config, cell, tiny_target, heads)[1])
        before = len(verifiers)
        records = run_cell(config, cell, tiny_target, heads, verifier_factory=counting, traces=cache)
        steps, replayed = map(pd.DataFrame, records)
        pd.testing.assert_frame_equal(replayed[columns], live[columns])
        assert replayed["wall_s"].isna().all() and steps["verify_s"].isna().all()
        assert replayed["committed"].sum() > replayed["steps"].sum()  # drafts were accepted
        if name == "merged":  # the second cell reuses the first cell's traces: no target run at all
            assert len(verifiers) == before
    assert len(verifiers) == 4  # two turns, each one greedy decode + one feature forward, for the first cell only


def test_report_says_which_cells_were_replayed(tiny_config):
    meta = [
        {"head_kind": "none", "proposer": "plain", "benchmark": "gsm8k", "temperature": 0.0, "replayed": False},
        {"head_kind": "eagle2", "proposer": "math", "benchmark": "gsm8k", "temperature": 0.0, "replayed": True},
        {"head_kind": "eagle2", "proposer": "math", "benchmark": "gsm8k", "temperature": 1.0},  # an older store
    ]
    empty = pd.DataFrame()
    text = evaluation_md(ReportData(config=tiny_config, summary=empty, entropy=empty, routing=empty, meta=meta))
    assert "1 cells replayed, 2 live" in text
    assert "replayed: `eagle2/math/gsm8k/T0`" in text
    assert "live: `eagle2/math/gsm8k/T1`, `none/plain/gsm8k/T0`" in text


@pytest.mark.slow
def test_replay_equals_the_live_loop_on_smollm2_fp32(tiny_config, smollm2_fp32):
    """The real target in fp32: exact up to counted near-ties (none measured on these prompts)."""
    target = smollm2_fp32
    tok = target.tokenizer
    questions = ("What is 15 + 27? Answer briefly.", "Name three colours.", "Solve 3x = 12.", "Say hello.")
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)["input_ids"]
        for q in questions
    ]
    heads = _fitted_heads(target, prompts, 24)
    tree = TreeConfig(total_token=8, depth=3, top_k=3)
    stops = target.stop_token_ids
    traces = record_traces(_verifier(target.model), prompts, 24, stops, lookahead=tree.depth + 1)
    differ = turns = 0
    for name in proposer_names(tiny_config):
        proposer = build_proposer(name, target, heads, tree)
        live = run_loop(TargetBatch(target.model), proposer, prompts, GREEDY, 24, stops)
        replayed = replay(proposer, traces, 24, stops)
        d, n = compare(live, replayed)
        differ, turns = differ + d, turns + n
        if name != "plain":
            assert sum(s.accepted for g in replayed for s in g.steps) > 0, name
    print(f"near-tie exceptions: {differ} of {turns} (proposer, question) pairs")
    assert differ <= turns // 20
