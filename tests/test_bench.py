"""`taps bench` end to end on the tiny random target: every method decodes the same prompts, ours stay greedy."""

from __future__ import annotations

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
