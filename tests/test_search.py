"""The mixture search (`taps search`): the sampled mixtures, ASHA over held-out agreement on Ray Tune, the
`searched` head it saves, Tuner.restore on a rerun, and the head joining the study as the `searched` proposer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from taps_ray.config import StudyConfig
from taps_ray.data.mixtures import mixture_counts
from taps_ray.drafting.combine import EntropyRouted
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.registry import build_proposer
from taps_ray.drafting.setup import heads_needed, load_heads, load_proposers
from taps_ray.eval.cell import Cell
from taps_ray.eval.commands import cmd_eval, plan_cells, results_store
from taps_ray.models.draft_head import new_head
from taps_ray.study.search import heldout_agreement, ratio_grid, run_search, trial_config
from taps_ray.training.features import extract_features, features_folder
from taps_ray.workdir import head_checkpoint, head_dir, searched_head


def _search_config(base: StudyConfig, work: Path, **search) -> StudyConfig:
    # lr 1e-2: the tiny random target's heads then reach agreements that differ by ratio (0.12-0.16)
    train = base.train.model_copy(update={"kinds": ["eagle2"], "mixtures": ["math", "chat"], "lr": 1e-2})
    settings = {"math_ratio": (0.25, 0.75), "ratio_step": 0.25, "sizes": [16], "num_samples": 3, "max_epochs": 3,
                "grace_period": 1, "reduction_factor": 2, **search}
    return base.model_copy(update={
        "train": train, "search": base.search.model_copy(update=settings),
        "ray": base.ray.model_copy(update={"trial_cpus": 0.5}), "work_dir": str(work),
        "reports_dir": str(work / "reports")})


def test_trial_mixtures_sample_the_ratio_grid(tiny_config, tmp_path):
    cfg = _search_config(tiny_config, tmp_path, math_ratio=(0.1, 1.0), ratio_step=0.2)
    assert ratio_grid(cfg) == [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    trial, name = trial_config(cfg, 0.25, 16)
    assert name == "search-m0.25-n16" and head_dir(trial, "eagle2", name).name == "eagle2-search-m0.25-n16"
    assert mixture_counts(trial.mixtures[name]) == {"mathinstruct": 4, "sharegpt": 12}
    assert trial.train.epochs == 3 and trial.mixtures["math"] == cfg.mixtures["math"]
    eagle3 = cfg.model_copy(update={"search": cfg.search.model_copy(update={"kind": "eagle3"})})
    assert trial_config(eagle3, 0.25, 16)[0].train.kinds == ["eagle2", "eagle3"]  # its features keep eagle3's layers
    only_math, pure = trial_config(cfg, 1.0, 16)
    assert only_math.mixtures[pure].mixture == {"mathinstruct": 1.0}  # a zero share is left out, not 0.0


def test_searched_head_joins_the_study_alone(tiny_config, tiny_target, tmp_path):
    cfg = _search_config(tiny_config, tmp_path)
    for seed, name in enumerate(["math", "chat"], start=1):
        new_head(tiny_target.model.config, seed=seed, kind="eagle2", trained_on=name).save(
            head_checkpoint(cfg, "eagle2", name))
    before = {c.proposer for c in plan_cells(cfg)}
    assert "searched" not in before and list(load_heads(cfg, "eagle2", tiny_target.dtype)) == ["math", "chat"]

    new_head(tiny_target.model.config, seed=3, kind="eagle2").save(searched_head(cfg, "eagle2"))
    heads = load_heads(cfg, "eagle2", tiny_target.dtype)
    assert list(heads) == ["math", "chat", "searched"]  # last: "first two" combinations keep math and chat
    assert heads_needed(cfg, ["searched"]) == ["searched"]
    proposer = build_proposer("searched", tiny_target, heads, cfg.tree)
    assert isinstance(proposer, SingleHead) and proposer.head is heads["searched"]
    # combinations draft with the study's heads only (drafting.setup keeps stand-alone heads out of them)
    routed = load_proposers(cfg, ["entropy-routed"], target=tiny_target, heads=heads)["entropy-routed"]
    assert isinstance(routed, EntropyRouted) and [p.name for p in routed.parts] == ["math", "chat", "averaged"]
    cells = plan_cells(cfg)
    assert {c.proposer for c in cells} == before | {"searched"}
    assert {c.head_kind for c in cells if c.proposer == "searched"} == {"eagle2"}
    assert {c.proposer for c in plan_cells(cfg, proposers=["math"])} == {"plain", "math"}  # a named list stays


def test_search_picks_the_best_ratio_and_restores(ray_session, tiny_config, tiny_target, tmp_path):
    cfg = _search_config(tiny_config, tmp_path / "work")
    for name in cfg.search.heldout:
        extract_features(cfg, name, target=tiny_target, progress=False)
    result = run_search(cfg, log_line=lambda _: None)
    assert not result["restored_experiment"] and result["failed"] == 0 and len(result["trials"]) == 3
    assert {t["math_ratio"] for t in result["trials"]} <= {0.25, 0.5, 0.75}
    assert all(t["epochs"] in (1, 2, 3) and 0 <= t["agreement"] <= 1 for t in result["trials"])
    assert len({t["agreement"] for t in result["trials"]}) > 1 and max(t["agreement"] for t in result["trials"]) > 0
    for trial in result["trials"]:  # the trial's features were copied from the math and chat sets
        trial_cfg, name = trial_config(cfg, trial["math_ratio"], trial["size"])
        stats = json.loads((features_folder(trial_cfg, name) / "manifest.json").read_text())["stats"]
        assert stats["computed_tokens"] == 0 and stats["copied_conversations"] == stats["conversations"] > 0
    best = result["best"]
    assert round(best["agreement"], 4) == max(t["agreement"] for t in result["trials"])
    head = searched_head(cfg, "eagle2")
    measured = heldout_agreement(cfg, head, tiny_target)  # the saved head is the one that scored it
    assert measured["agreement"] == pytest.approx(best["agreement"], abs=1e-6)
    assert measured["agreement_math"] == pytest.approx(best["agreement_math"], abs=1e-6)
    metrics = json.loads((head / "metrics.json").read_text())
    assert metrics["search"] == best and metrics["history"][-1]["epoch"] == best["epoch"]

    trained = {p: p.stat().st_mtime_ns for p in Path(cfg.work_dir, "heads").glob("*/epoch-*/model.safetensors")}
    saved = head.joinpath("model.safetensors").read_bytes()
    again = run_search(cfg, log_line=lambda _: None)  # the same experiment: restored, nothing retrained
    assert again["restored_experiment"] and again["experiment"] == result["experiment"]
    assert again["best"] == best and again["trials"] == result["trials"]
    assert {p: p.stat().st_mtime_ns for p in trained} == trained

    shutil.rmtree(head)  # the searched head lost: the restored experiment writes it again from Tune's checkpoint
    restored = run_search(cfg, log_line=lambda _: None)
    assert restored["restored_experiment"] and restored["best"] == best
    assert head.joinpath("model.safetensors").read_bytes() == saved
    assert [p.name for p in Path(result["experiment"]).parent.iterdir()] == [Path(result["experiment"]).name]


def test_eval_of_one_head_needs_only_that_head(tiny_config, tiny_target, tmp_path):
    """`taps eval --proposers math` runs with the math head alone trained; a combination names what is missing."""
    evaluation = tiny_config.eval.model_copy(update={"benchmarks": {"gsm8k": 1}, "max_new_tokens": 4})
    cfg = _search_config(tiny_config, tmp_path).model_copy(update={"eval": evaluation})
    new_head(tiny_target.model.config, seed=1, kind="eagle2", trained_on="math").save(
        head_checkpoint(cfg, "eagle2", "math"))
    assert cmd_eval(cfg, plan_cells(cfg, proposers=["math"], temperatures=[0.0])) == 0
    assert results_store(cfg).is_done(Cell("eagle2", "math", "gsm8k", 0.0))
    with pytest.raises(FileNotFoundError, match="mixture 'chat'"):
        cmd_eval(cfg, plan_cells(cfg, proposers=["merged"], temperatures=[0.0]))

