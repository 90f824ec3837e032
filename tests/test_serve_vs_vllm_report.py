"""The serving comparison's report (benchmarks/serving/serve_vs_vllm.py): repeated points become medians, with
each run listed and the ratio to vLLM taken within each repetition, not across the whole run."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("serve_vs_vllm", REPO / "benchmarks" / "serving" / "serve_vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(server: str, repeat: int, tok_s: float, ttft: float, model: str = "plain") -> dict:
    metrics = {f"{m}_{p}_ms": ttft if m == "ttft" else 10.0 for m in ("ttft", "tpot", "itl") for p in ("p50", "p99")}
    return {"server": server, "dtype": "float32", "model": model, "load": "c4", "threads": "t", "repeat": repeat,
            "output_tok_s": tok_s, "completed": 32, "failed": 0, "output_tokens": 2048, **metrics}


def test_repeated_points_report_medians_every_run_and_the_median_paired_ratio():
    harness = _harness()
    rows = [_row("vLLM", r, tok, ttft) for r, tok, ttft in ((0, 10.0, 300), (1, 20.0, 100), (2, 12.0, 200))]
    rows += [_row("taps", r, tok, ttft) for r, tok, ttft in ((0, 9.0, 250), (1, 22.0, 90), (2, 6.0, 400))]
    vllm, taps = harness.repeated(rows)
    assert (vllm["output_tok_s"], vllm["ttft_p50_ms"], vllm["runs"]) == (12.0, 200, [10.0, 20.0, 12.0])
    assert (taps["output_tok_s"], taps["ttft_p50_ms"], taps["runs"]) == (9.0, 250, [9.0, 22.0, 6.0])
    # paired ratios 0.9, 1.1, 0.5: their median, not the ratio of the medians (9 / 12 = 0.75)
    assert abs(taps["paired_ratio"] - 0.9) < 1e-12 and abs(vllm["paired_ratio"] - 1.0) < 1e-12
    line = next(line for line in harness.table([vllm, taps]) if line.startswith("| taps"))
    assert "| 9.0 | 9.0 / 22.0 / 6.0 | 0.90x |" in line


def test_a_single_run_reports_the_ratio_of_its_throughputs():
    harness = _harness()
    lines = harness.table([_row("vLLM", 0, 10.0, 300), _row("taps", 0, 8.0, 250)])
    assert "runs" not in lines[0]
    assert "| 8.0 | 0.80x |" in next(line for line in lines if line.startswith("| taps"))


def test_a_point_without_vllm_shows_no_ratio():
    harness = _harness()
    rows = harness.repeated([_row("taps", r, tok, 100) for r, tok in ((0, 8.0), (1, 9.0))])
    line = next(line for line in harness.table(rows) if line.startswith("| taps"))
    assert "| 8.5 | 8.0 / 9.0 | — |" in line and "nan" not in line


def test_vllm_drafting_with_our_head_is_compared_with_vllm_plain_not_taken_for_it():
    harness = _harness()
    for rows in ([_row("vLLM", 0, 10.0, 300), _row("vLLM", 0, 15.0, 280, "eagle3-math"), _row("taps", 0, 12.0, 250)],
                 [_row("vLLM", 0, 15.0, 280, "eagle3-math"), _row("vLLM", 0, 10.0, 300), _row("taps", 0, 12.0, 250)]):
        lines = harness.table(rows)
        assert "| 15.0 | 1.50x |" in next(line for line in lines if "eagle3-math" in line)
        assert "| 12.0 | 1.20x |" in next(line for line in lines if line.startswith("| taps"))
        ratios = {(row["server"], row["model"]): row["paired_ratio"] for row in harness.repeated(rows)}
        assert ratios == {("vLLM", "plain"): 1.0, ("vLLM", "eagle3-math"): 1.5, ("taps", "plain"): 1.2}


def test_engine_alone_rows_show_no_tpot_and_keep_their_ratio():
    harness = _harness()
    engine = {**_row("taps engine", 0, 15.0, 200), "tpot_p50_ms": float("nan"), "tpot_p99_ms": float("nan")}
    rows = harness.repeated([_row("vLLM", 0, 10.0, 300), _row("taps", 0, 8.0, 250), engine])
    line = next(line for line in harness.table(rows) if line.startswith("| taps engine"))
    assert "| 1.50x | 200 / 200 | — / — | 10 / 10 |" in line and "nan" not in line


def test_engine_alone_times_serves_engine_in_a_child_process():
    """The closed loop of benchmarks/serving/engine_alone.py, end to end on the tiny target: every request decodes
    its tokens (ignore_eos), at each concurrency, and the timings come back through the child's JSON."""
    harness = _harness()
    rows = harness.engine_alone.run(str(REPO / "configs" / "tiny.yaml"), "float32", 1, 4, [1, 4], 4, 6)
    assert len(rows) == 2
    for row in rows:
        assert row["output_tokens"] == 4 * 6 and row["completed"] == 4 and row["output_tok_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert row["tpot_p50_ms"] != row["tpot_p50_ms"]  # NaN: a closed loop has no TPOT of vLLM's definition


def test_the_regenerate_line_names_the_target_that_trains_the_served_heads():
    harness = _harness()
    assert harness.prerequisites("configs/data_size.yaml", "plain", {}) == "make vllm-venv"
    assert harness.prerequisites("runs/cpu-quick/config.yaml", "plain", {}) == "make vllm-venv sweep-quick"
    assert harness.prerequisites("configs/cpu.yaml", "plain", {}) == "make vllm-venv"
    assert harness.prerequisites("configs/cpu.yaml", "plain", {}, "configs/data_size.yaml") == "make vllm-venv sweep"
    assert harness.prerequisites("runs/cpu-quick/config.yaml", "plain,routed", {}) == "make vllm-venv sweep-quick"
    assert harness.prerequisites("configs/interop.yaml", "plain", {"eagle3-math": {}}) == "make vllm-venv interop"


def test_taps_servers_cross_listeners_with_openmp_waits_and_each_config_loads(tmp_path):
    from taps_ray.config import load_config

    harness = _harness()
    variants = harness.taps_variants("proxy,replica", "default,passive")
    assert variants == [{"listener": "proxy", "replica_omp_wait": "default"},
                        {"listener": "proxy", "replica_omp_wait": "passive"},
                        {"listener": "replica", "replica_omp_wait": "default"},
                        {"listener": "replica", "replica_omp_wait": "passive"}]
    assert harness.taps_variants("", "") == [{}] and harness.variant_name({}, 1) == "taps"
    assert harness.variant_name(variants[1], 4) == "taps, proxy listener, OpenMP wait passive"
    paths = {harness.taps_config(str(REPO / "configs" / "data_size.yaml"), "bfloat16", 16, 2, 8123, tmp_path, v)
             for v in variants}
    assert len(paths) == 4  # a file each: one server's config does not overwrite another's
    for path in paths:
        serve = load_config(path).serve
        assert (serve.max_batch_size, serve.port, serve.replica_num_cpus) == (16, 8123, 2)
        assert f"taps-data-size-bfloat16-{serve.listener}-{serve.replica_omp_wait}.yaml" == path.name


def test_taps_servers_cross_head_kinds_and_each_serves_its_kind(tmp_path):
    """--head-kinds: our server on each kind's heads, as vLLM serves one exported head (--vllm-heads)."""
    from taps_ray.config import load_config

    harness = _harness()
    variants = harness.taps_variants("replica", "", "eagle2,eagle3")
    assert variants == [{"listener": "replica", "head_kind": "eagle2"}, {"listener": "replica", "head_kind": "eagle3"}]
    assert harness.variant_name(variants[1], 2) == "taps, replica listener, eagle3 heads"
    kinds = {load_config(harness.taps_config(str(REPO / "configs" / "interop.yaml"), "float32", 16, 2, 8123,
                                             tmp_path, variant)).serve.head_kind for variant in variants}
    assert kinds == {"eagle2", "eagle3"}


def test_plain_configs_are_servers_of_their_own_named_by_their_config(tmp_path):
    harness = _harness()
    cpu, data_size = str(REPO / "configs" / "cpu.yaml"), str(REPO / "configs" / "data_size.yaml")
    assert harness.config_label(cpu, 1) == ""
    assert harness.config_label(data_size, 2) == " (data-size)"
    one = harness.taps_config(cpu, "float32", 16, 2, 8123, tmp_path, {})
    other = harness.taps_config(data_size, "float32", 16, 2, 8124, tmp_path, {})
    assert one != other  # two servers of two configs do not share a derived config file


def test_each_point_warms_the_server_at_its_load_before_the_client_measures(tmp_path, monkeypatch):
    harness = _harness()
    assert [harness.warm_up_requests(load, 1) for load in ("c1", "c16", "r2.5")] == [1, 16, 3]
    assert harness.warm_up_requests("c4", 2) == 8 and harness.warm_up_requests("c4", 0) == 0
    sent = []

    def client(command, **_):
        sent.append(command)
        raise RuntimeError("stop here")

    monkeypatch.setattr(harness.subprocess, "run", client)
    monkeypatch.setattr(harness, "smollm2_folder", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="stop here"):
        harness.run_client(tmp_path, 8000, "plain", tmp_path / "prompts.jsonl", 32, 64, "c16", tmp_path, 1)
    command = sent[0]
    assert command[command.index("--num-warmups") + 1] == "16"
    assert command[command.index("--max-concurrency") + 1] == "16"


def test_each_run_rotates_which_model_a_server_measures_first():
    harness = _harness()
    models = ["plain", "math", "routed"]
    orders = [harness.turn_order(models, repeat) for repeat in range(4)]
    assert [order[0] for order in orders] == ["plain", "math", "routed", "plain"]
    assert all(sorted(order) == sorted(models) for order in orders)


def test_a_server_that_does_not_list_a_model_to_measure_stops_the_run_before_any_point(tmp_path, monkeypatch):
    """`taps serve` leaves out a drafting model whose heads are untrained: the run stops at once, naming the model
    and the server's log, instead of reporting its failed requests as 0 tok/s half an hour later."""
    harness = _harness()

    class Listing:
        status_code = 200

        @staticmethod
        def json() -> dict:
            return {"object": "list", "data": [{"id": "plain", "object": "model"}]}

    monkeypatch.setattr(harness.httpx, "get", lambda *_, **__: Listing())
    server = harness.Server("taps serve", ["sleep", "60"], {}, 8123, tmp_path / "taps.log")
    server.wait_ready(5, ["plain"])  # everything asked for is served: no error
    assert server.proc.poll() is None
    with pytest.raises(SystemExit, match=r"does not serve \['math'\] \(it serves \['plain'\]\).*taps\.log"):
        server.wait_ready(5, ["plain", "math"])
    assert server.proc.poll() is not None  # stopped, not left running


def test_stopping_a_paused_server_resumes_children_in_process_groups_of_their_own(tmp_path):
    """Ray runs Serve's controller and replica in process groups of their own; `taps serve` drains through them
    on SIGINT. A SIGCONT to the server's group left them stopped, so every paused server's stop waited a minute
    for its SIGKILL. Here the server's SIGINT handler waits for such a child, as the drain does."""
    harness = _harness()
    server_code = ("import signal, subprocess, sys, time\n"
                   "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], process_group=0)\n"
                   "def stop(*_):\n"
                   "    child.terminate(); child.wait(); sys.exit(0)\n"
                   "signal.signal(signal.SIGINT, stop)\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(600)\n")
    log = tmp_path / "server.log"
    server = harness.Server("server", [sys.executable, "-c", server_code], {}, 8123, log)
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = server._tree()[1]
    assert os.getpgid(child.pid) != os.getpgid(server.proc.pid)  # the case Ray's workers are in
    server.pause()
    assert child.status() == psutil.STATUS_STOPPED
    started = time.monotonic()
    server.stop()
    assert server.proc.returncode == 0  # the handler ran to its end: no SIGKILL
    assert time.monotonic() - started < 30
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
