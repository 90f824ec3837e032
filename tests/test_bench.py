"""`taps bench` end to end on the tiny random target (every method decodes the same prompts, ours stay greedy),
and the pure helpers of `benchmarks/serve_load.py` (stream reading, outcome classes, the overload verdict)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from taps_ray.bench import BenchOptions, cmd_bench, run_bench
from taps_ray.models.draft_head import new_head
from taps_ray.workdir import head_checkpoint


@pytest.fixture(scope="module")
def bench_config(tiny_config, tiny_target, tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-work")
    cfg = tiny_config.model_copy(update={"work_dir": str(work), "reports_dir": str(work / "reports")})
    for seed, mixture in enumerate(("math", "chat"), start=1):
        new_head(tiny_target.model.config, seed=seed).save(head_checkpoint(cfg, "eagle2", mixture))
    return cfg


def test_bench_ours_match_greedy_and_tree_rows(bench_config):
    options = BenchOptions(proposers=["math", "merged", "ngram", "math+ngram"], per_benchmark=1, max_new_tokens=8,
                           repetitions=1, trees=["4/2/2"], peers=False)
    table, runs = run_bench(bench_config, options)
    methods = ["plain", "math", "merged", "ngram", "math+ngram", "math@4/2/2"]
    assert list(table.loc[table["prompts"] == "all", "method"]) == methods
    assert (table["identical_to_greedy"] == 1.0).all()  # fp32 tiny target: every proposer equals plain greedy
    assert runs["math@4/2/2"].steps > 0 and (table["tokens_per_s"] > 0).all()


def test_bench_report_with_peers(bench_config):
    options = BenchOptions(proposers=["math"], benchmarks=["gsm8k"], per_benchmark=1, max_new_tokens=6,
                           repetitions=1)
    assert cmd_bench(bench_config, options, "taps bench (test)") == 0
    text = (Path(bench_config.reports_dir) / "bench.md").read_text()
    for method in ("hf-greedy", "hf-prompt-lookup", "hf-assisted-early-exit", "plain", "math"):
        assert f"| {method} |" in text
    assert "Per-step profile" in text and "EAGLE-2's published speedup" in text


def test_bad_tree_setting_names_the_format(bench_config):
    with pytest.raises(ValueError, match="total_token/depth/top_k"):
        BenchOptions(trees=["8-3-2"]).tree_configs(bench_config.tree)


def _serve_load():
    """benchmarks/serve_load.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_serve_load_reads_a_stream_and_classifies_outcomes():
    sl = _serve_load()
    out = sl.Outcome("math", "q", status=200)
    sl.apply_chunk(out, {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}, 0.1)
    assert out.ttft is None  # a chunk without content is not the first token
    sl.apply_chunk(out, {"choices": [{"delta": {"content": "4"}, "finish_reason": None}]}, 0.2)
    sl.apply_chunk(out, {"choices": [{"delta": {"content": "2"}, "finish_reason": None}]}, 0.3)
    sl.apply_chunk(out, {"choices": [{"delta": {}, "finish_reason": "stop"}],
                         "speculative": {"tau": 1.5, "batch_size": 3}}, 0.4)
    sl.apply_chunk(out, {"choices": [], "usage": {"completion_tokens": 2}}, 0.4)
    assert (out.text, out.ttft, out.tau, out.batch, out.tokens) == ("42", 0.2, 1.5, 3, 2)
    assert out.finished and out.kind == "ok"
    sl.apply_chunk(out, {"error": {"message": "decoding failed"}}, 0.5)
    assert out.kind == "lost"
    assert sl.Outcome("m", "q", status=503, retry_after="2").kind == "503"
    assert sl.Outcome("m", "q", status=503, retry_after="0").kind == "503 without Retry-After"
    assert sl.Outcome("m", "q", status=503).kind == "503 without Retry-After"
    assert sl.Outcome("m", "q", status=500).kind == "other 5xx"
    assert sl.Outcome("m", "q", status=400).kind == "4xx"
    assert sl.Outcome("m", "q").kind == "lost"
    assert sl.Outcome("m", "q", status=200, timed_out=True, problem="slow").kind == "hung"
    assert sl.parse_clients("1,4,8,16") == [1, 4, 8, 16]
    with pytest.raises(Exception, match="distinct positive"):
        sl.parse_clients("1,0")


def test_serve_load_summary_and_overload_verdict():
    sl = _serve_load()
    answers = [sl.Outcome("plain", "q", status=200, latency=latency, ttft=latency / 4, text=text, tokens=10,
                          tau=1.0, batch=2, finished=True) for latency, text in ((1.0, "a"), (3.0, "b"))]
    rejected = sl.Outcome("plain", "q", status=503, latency=0.01, retry_after="1", problem="busy")
    stats = sl.summarize([*answers, rejected], 2.0, {"q": "a"}, ("ok", "503"))
    assert (stats["ok"], stats["errors"], stats["tokens_per_s"], stats["p50"]) == (2, 1, 10.0, 2.0)
    assert (stats["ttft50"], stats["mismatches"], stats["retry_after"]) == (0.5, 1, [1])
    assert stats["rejection"] == "busy" and stats["error_samples"] == []  # a 503 is expected here
    assert sl.overload_failures(stats, idle=True) == ["1 answers differ from greedy"]
    hung = sl.Outcome("plain", "q", status=200, timed_out=True, problem="slow")
    stats = sl.summarize([answers[0], hung], 2.0, None, ("ok", "503"))
    assert sl.overload_failures(stats, idle=False) == [
        "1 hung", "no 503: the run never filled the queue", "the replica still had requests 30 s after the run"]
