"""The command line as a new user meets it (issue 44): every mistake is one line on stderr naming the problem and
the fix, exit code 2, before any model loads; nothing at --out is replaced without --force; every subcommand's
help shows its defaults and an example. Each case runs the real `taps` CLI in a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from taps_ray.cli import build_parser
from taps_ray.config import load_config
from taps_ray.models.draft_head import new_head
from taps_ray.study.sweep import quick_config
from taps_ray.workdir import head_checkpoint, save_config

REPO = Path(__file__).resolve().parents[1]


def taps(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`taps ARGS` from this checkout, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "taps_ray.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=300)


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The single stderr line of a refused command (exit 2, nothing on stdout), which contains every needle."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, result.stderr
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> Path:
    """A tiny study's config file whose work dir holds no heads."""
    folder = tmp_path_factory.mktemp("cli")
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_config.model_copy(update={"work_dir": str(folder / "work")})
                                   .model_dump(mode="json")))
    return path


# --- argument mistakes: argparse, one line ----------------------------------------------------------------------


def test_bad_counts_and_empty_prompt_are_one_line(study):
    one_line_error(taps("data", "show", "gsm8k", "-n", "-2"), "-n", "-2 is not a positive count")
    one_line_error(taps("generate", "--config", str(study), "--prompt", "  "), "--prompt", "empty")
    one_line_error(taps("generate", "--config", str(study), "--prompt", "x", "--temperature", "-1"), "below 0")
    one_line_error(taps("train", "--config", str(study), "--kind", "eagle9", "--mixture", "math"),
                   "--kind", "invalid choice", "taps train --help")


def test_data_dir_works_after_the_subcommand(tmp_path):
    result = taps("data", "list", "--data-dir", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and f"searched {tmp_path}" in result.stderr  # the flag was read, not refused


def test_version_and_every_help_has_defaults_and_an_example():
    assert taps("--version").stdout.strip() == "taps 0.1.0"
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        text = sub.format_help()
        assert f"example:\n  taps {name}" in text or "example:\n  taps data" in text, name
    assert "(default: eagle2)" in commands["generate"].format_help()
    assert "(default: 128)" in commands["generate"].format_help()


def test_one_flag_per_concept_with_the_old_spellings_hidden():
    parse = build_parser().parse_args
    assert parse(["eval", "--config", "c", "--kind", "hass"]).kinds == ["hass"]
    assert parse(["eval", "--config", "c", "--kinds", "hass"]).kinds == ["hass"]
    assert parse(["serve", "--config", "c", "--head-kind", "hass"]).kind == "hass"
    assert parse(["heads-report", "--config", "c", "--output", "o"]).out == "o"
    assert parse(["plan", "--config", "c", "--doc", "d.md"]).out == "d.md"
    assert parse(["bench", "--config", "c", "--name", "n"]).name == "n"
    assert parse(["bench", "--config", "c", "--out", "n"]).name == "n"
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--head-kind" not in help_text and "--kind" in help_text


# --- names checked before any model loads ----------------------------------------------------------------------


def test_misspelt_proposer_gets_a_near_miss_and_routed_is_a_name(study):
    one_line_error(taps("generate", "--config", str(study), "--proposer", "maths", "--prompt", "hi"),
                   "unknown proposer 'maths'", "did you mean 'math'?")
    one_line_error(taps("eval", "--config", str(study), "--proposers", "mergd"), "did you mean 'merged'?")
    # `routed` (README, Serve) is a proposer here too: what stops it is the missing head, named with its fix
    one_line_error(taps("generate", "--config", str(study), "--proposer", "routed", "--prompt", "hi"),
                   "no trained eagle2 head for mixture 'math'", "taps train")


# --- taps plan --cluster ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, needle", [
    (None, "not found"),
    ("", "is empty"),
    ("- a\n- b\n", "is a list"),
    ("cluster_name: x\n", "provider is missing"),
    ("cluster_name: x\nprovider: {type: aws}\navailable_node_types: 3\n", "available_node_types"),
    ("cluster_name: x\nprovider: {type: aws}\navailable_node_types:\n  gpu:\n    resorces: {GPU: 1}\n"
     "    node_config: {}\n", "did you mean 'resources'?"),
    ("cluster_name: x\nprovider: {type: aws}\navailable_node_types:\n  gpu:\n    resources: {GPU: one}\n"
     "    node_config: {}\n", "resources.GPU"),
])
def test_plan_refuses_a_malformed_cluster_file(tmp_path, text, needle):
    path = tmp_path / "cluster.yaml"
    if text is not None:
        path.write_text(text)
    one_line_error(taps("plan", "--config", "configs/paper.yaml", "--cluster", str(path)), "cluster file", needle)


# --- nothing deleted unasked ------------------------------------------------------------------------------------


def test_export_never_replaces_without_force(study, tiny_target, tmp_path):
    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "keep").write_text("mine")
    args = ["export", "--config", str(study), "--kind", "eagle2", "--mixture", "math"]
    one_line_error(taps(*args, "--out", str(kept)), "already there", "--force")
    assert (kept / "keep").read_text() == "mine"
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    one_line_error(taps(*args, "--out", str(a_file)), "a file is already there")
    one_line_error(taps(*args, "--out", str(a_file / "sub")), "is a file, not a folder")
    assert a_file.read_text() == "mine"

    cfg = load_config(study)
    new_head(tiny_target.model.config, seed=1, kind="eagle2", trained_on="math").save(
        head_checkpoint(cfg, "eagle2", "math"))
    result = taps(*args, "--out", str(kept), "--force")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or swapped-out folder left


# --- the quick sweep's heads are usable as they are --------------------------------------------------------------


def test_saved_config_reads_back_as_the_config_that_ran(tmp_path):
    quick = quick_config(load_config(REPO / "configs" / "cpu.yaml"))
    path = save_config(quick, tmp_path / "config.yaml")
    assert load_config(path) == quick
    assert quick.work_dir == "runs/cpu-quick"


# --- taps generate's figure ---------------------------------------------------------------------------------------


def test_generate_times_interleaved_warm_runs(study):
    result = taps("generate", "--config", str(study), "--proposer", "ngram", "--prompt", "Count: 1 2 3 1 2 3",
                  "--max-new-tokens", "8", "--repetitions", "3", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    low, high = out["speedup_range"]
    assert out["repetitions"] == 3 and low <= high and out["tokens_per_s"] > 0
    assert out["identical_to_plain"] and out["note"] == ""  # fp32, greedy: token for token


def test_a_16_bit_mismatch_is_explained_as_rounding():
    from taps_ray.eval.commands import _mismatch_note

    assert "rounding, not a bug" in _mismatch_note(False, "bfloat16")
    assert _mismatch_note(False, "float32") == _mismatch_note(True, "bfloat16") == ""


def test_misspelt_mixture_and_missing_files_are_one_line(study, tmp_path):
    one_line_error(taps("features", "--config", str(study), "--mixture", "maths"), "did you mean 'math'?")
    one_line_error(taps("plan", "--config", "configs/paper.yaml", "--out", str(tmp_path / "none.md")),
                   "not found", "taps plan: begin")
    one_line_error(taps("heads-report", "--config", str(study), "--render-only", "--out", str(tmp_path)),
                   "no heads.json", "without --render-only")


def test_report_rebuilds_from_a_results_copy_alone(tmp_path):
    """`taps report --results <copy>`: the copy holds its config, so no --config; the report lands beside the copy."""
    copy = tmp_path / "reports" / "results"
    copy.mkdir(parents=True)
    bare = taps("report", "--results", str(copy))
    assert bare.returncode == 2
    one_line_error(bare, "neither a results store")
    config = load_config("configs/tiny.yaml").model_copy(update={"reports_dir": str(tmp_path / "elsewhere")})
    save_config(config, copy / "config.yaml")
    pd.DataFrame({"question_id": []}).to_parquet(copy / "questions.parquet")
    built = taps("report", "--results", str(copy))
    assert built.returncode == 0, built.stderr
    readme = (tmp_path / "reports" / "README.md").read_text()
    assert readme.startswith("# TAPS reproduction report — `tiny`") and not (tmp_path / "elsewhere").exists()
    (copy / "config.yaml").unlink()
    missing = taps("report", "--results", str(copy))
    assert missing.returncode == 2
    one_line_error(missing, "needs --config", "config.yaml")
