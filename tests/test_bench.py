"""`taps bench` end to end on the tiny random target (every method decodes the same prompts, ours stay greedy),
its pure parts (prompt choice, speed table, goals, limits), and the pure helpers of `benchmarks/serving/serve_load.py`
(stream reading, outcome classes, the overload verdict)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pandas as pd

from taps_ray.bench.prompts import OOD_PROMPTS, first_turns, spread
from taps_ray.bench.report import BenchSection, goal_rows, limit_lines
from taps_ray.bench.run import BenchOptions, Decoded, MethodRun, cmd_bench, first_per_label, run_bench, speed_table
from taps_ray.data.sources import Question
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
    options = BenchOptions(proposers=["math", "merged", "ngram", "auto-math+ngram"], per_benchmark=1,
                           categories=["code"], per_category=1, max_new_tokens=8, repetitions=1, trees=["4/2/2"],
                           peers=False, dtypes=[None])
    [section] = run_bench(bench_config, options)
    table = section.table
    methods = ["plain", "math", "merged", "ngram", "auto-math+ngram", "math@4/2/2"]
    assert list(table.loc[table["prompts"] == "all", "method"]) == methods
    assert set(table["prompts"]) == {"all", "gsm8k", "mt_bench", "ood-code"}
    assert (table["identical_to_greedy"] == 1.0).all()  # fp32 tiny target: every proposer equals plain greedy
    assert (table["tokens_per_s"] > 0).all() and (table["n"] == table["prompts"].map({"all": 3}).fillna(1)).all()
    assert set(section.profiles) == {"all", "gsm8k", "mt_bench"}
    assert (section.profiles["all"]["step_ms"] > 0).all()


def test_bench_report_with_peers_and_two_dtypes(bench_config):
    options = BenchOptions(proposers=["math"], benchmarks=["gsm8k"], per_benchmark=2, categories=["writing"],
                           per_category=1, max_new_tokens=6, repetitions=1, slow_peer_prompts=1,
                           dtypes=["float32", "bfloat16"])
    assert cmd_bench(bench_config, options, "taps bench (test)") == 0
    text = (Path(bench_config.reports_dir) / "bench.md").read_text()
    for method in ("hf-greedy", "hf-prompt-lookup", "hf-assisted-early-exit", "plain", "math"):
        assert f"| {method} |" in text
    assert "## float32" in text and "## bfloat16" in text and "## Goals" in text
    assert "| float32 | best ≥ 2.0× plain on gsm8k, ahead of hf-prompt-lookup, identical to greedy |" in text
    assert "limits the next step." in text and "EAGLE-2's published speedup" in text
    assert "| hf-assisted-early-exit | all | 2 |" in text  # the slow peer decodes one prompt per label
    fp32, bf16 = text[text.index("## float32"):text.index("## bfloat16")], text[text.index("## bfloat16"):]
    assert "| plain | all | 3 |" in fp32 and "ood-writing" in fp32  # fp32 decodes every prompt
    assert "| plain | all | 2 |" in bf16 and "ood-writing" not in bf16  # bf16 only the first benchmark


def test_bad_tree_setting_names_the_format(bench_config):
    with pytest.raises(ValueError, match="total_token/depth/top_k"):
        BenchOptions(trees=["8-3-2"]).tree_configs(bench_config.tree)


def test_command_line_options_default_to_the_full_run():
    from taps_ray.cli import bench_options, build_parser

    parse = build_parser().parse_args
    assert bench_options(parse(["bench", "--config", "c.yaml"])) == BenchOptions()
    options = bench_options(parse(["bench", "--config", "c.yaml", "--dtype", "bf16", "--categories", "--no-peers",
                                   "--per-benchmark", "5", "--trees", "8/3/2", "--narrow"]))
    assert (options.dtypes, options.categories, options.peers, options.per_benchmark, options.trees) == (
        ["bfloat16"], [], False, 5, ["8/3/2"])
    assert options.narrow_dtypes == [] and BenchOptions().narrow_dtypes == ["bfloat16"]
    assert options.proposers == BenchOptions().proposers


def test_prompts_spread_through_a_set_and_label_categories():
    questions = [Question(i, f"c{i // 10}", [f"q{i}"]) for i in range(80)]
    assert [q.question_id for q in spread(questions, 4)] == [0, 20, 40, 60]
    assert spread(questions[:3], 5) == questions[:3]
    prompts = first_turns([], 0, ["translation", "code"], 2, None)
    assert prompts == [("ood-translation", OOD_PROMPTS["translation"][0]), ("ood-translation", OOD_PROMPTS["translation"][1]),
                       ("ood-code", OOD_PROMPTS["code"][0]), ("ood-code", OOD_PROMPTS["code"][1])]
    with pytest.raises(ValueError, match="unknown out-of-domain category 'poetry'"):
        first_turns([], 0, ["poetry"], 1, None)
    assert first_per_label(["a", "a", "b", "a", "b"], 1) == [0, 2]


def _run(seconds: dict[int, float], tokens: list[int], steps: int = 0) -> MethodRun:
    run = MethodRun()
    for i, s in seconds.items():
        run.add(i, Decoded(tokens, steps=steps, new_tokens=len(tokens) if steps else 0), s)
    return run


def test_speed_table_compares_on_the_prompts_a_method_decoded():
    labels = ["gsm8k", "gsm8k", "ood-code"]
    runs = {
        "hf-greedy": _run({0: 1.0, 1: 1.0, 2: 1.0}, [1, 2]),
        "plain": _run({0: 1.0, 1: 2.0, 2: 1.0}, [1, 2], steps=2),
        "slow": _run({0: 4.0}, [1, 3]),  # decoded prompt 0 only, and differs from greedy
        "fast": _run({0: 0.5, 1: 0.5, 2: 2.0}, [1, 2], steps=1),
    }
    table = speed_table(runs, labels).set_index(["method", "prompts"])
    assert table.loc[("slow", "all"), "n"] == 1 and table.loc[("slow", "all"), "speedup_vs_plain"] == 0.25
    assert table.loc[("slow", "all"), "identical_to_greedy"] == 0.0 and ("slow", "ood-code") not in table.index
    assert table.loc[("fast", "gsm8k"), "speedup_vs_plain"] == 3.0  # 4 tokens / 1 s against 4 tokens / 3 s
    assert table.loc[("fast", "ood-code"), "speedup_vs_plain"] == 0.5 and table.loc[("fast", "all"), "tau"] == 2.0
    assert pd.isna(table.loc[("hf-greedy", "all"), "tau"]) and table.loc[("plain", "all"), "tau"] == 1.0


def _section(dtype: str, rows: list[tuple[str, str, float, float]], benchmarks: list[str]) -> BenchSection:
    """rows: (method, scope, speedup_vs_plain, identical); our loop's rows get a tau, HF rows none."""
    table = pd.DataFrame([{"method": m, "prompts": p, "speedup_vs_plain": x, "identical_to_greedy": same,
                           "tau": None if m.startswith("hf-") else 1.0 + x} for m, p, x, same in rows])
    profile = pd.DataFrame([
        {"method": "plain", "draft_ms": 0.0, "forward_ms": 70.0, "accept_ms": 0.5, "commit_ms": 1.0,
         "other_ms": 3.5, "step_ms": 75.0, "tau": 1.0},
        {"method": "math+ngram", "draft_ms": 30.0, "forward_ms": 90.0, "accept_ms": 0.5, "commit_ms": 1.0,
         "other_ms": 3.5, "step_ms": 125.0, "tau": 2.5},
    ])
    return BenchSection(dtype, benchmarks, table, {"all": profile, "gsm8k": profile})


def test_goals_per_row_and_what_limits():
    rows = [("hf-prompt-lookup", "gsm8k", 1.6, 0.9), ("plain", "gsm8k", 1.0, 1.0), ("plain", "mt_bench", 1.0, 1.0),
            ("math+ngram", "gsm8k", 2.2, 1.0), ("math+ngram", "mt_bench", 0.9, 1.0), ("math+ngram", "all", 1.5, 1.0),
            ("ngram", "gsm8k", 2.5, 0.95), ("ngram", "mt_bench", 1.1, 1.0), ("math@4/2/2", "mt_bench", 0.5, 1.0)]
    goals = goal_rows(_section("float32", rows, ["gsm8k", "mt_bench"]))
    assert goals[0] == {"goal": "best ≥ 2.0× plain on gsm8k, ahead of hf-prompt-lookup, identical to greedy",
                        "method": "math+ngram", "measured": "2.20× (peer 1.60×, identical 1.00)", "met": "yes"}
    assert goals[1]["method"] == "ngram" and goals[1]["met"] == "yes"  # 1.10x on mt_bench
    floors = {g["method"]: (g["measured"], g["met"]) for g in goals[2:]}
    assert floors == {"math+ngram": ("worst 0.90× (mt_bench)", "no"), "ngram": ("worst 1.10× (mt_bench)", "yes")}
    no_peers = goal_rows(_section("float32", [r for r in rows if not r[0].startswith("hf-")], ["gsm8k"]))
    assert no_peers[0]["measured"] == "2.20× (peer not run, identical 1.00)" and no_peers[0]["met"] == "no"
    bf16 = goal_rows(_section("bfloat16", rows, ["gsm8k"]))  # identity not required: ngram's 2.5x counts
    assert bf16[0]["method"] == "ngram" and len(bf16) == 3
    [line] = limit_lines(_section("float32", rows, ["gsm8k"]))
    assert "`math+ngram` commits 2.50 tokens per step" in line and "1.50×" in line  # 2.5 * 75 / 125
    assert "tau ≥ 3.33" in line and "≤ 93.8 ms" in line and "**drafting** limits the next step" in line


def _serve_load():
    """benchmarks/serving/serve_load.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serving" / "serve_load.py"
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
