"""The GPU smoke's CPU fallback (benchmarks/gpu/gpu_smoke.py --cpu): the same checks on small shapes, in a process
where Ray, datasets and gguf cannot be imported, as on the bare GPU machine the smoke is for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "datasets", "gguf")  # absent on the borrowed GPU machine


def test_gpu_smoke_refuses_to_fall_back_quietly_without_cuda(tmp_path):
    """Without --cpu, a machine whose torch sees no GPU is an error (exit 2), never a CPU run called a GPU one."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "gpu_smoke.py"), "--out", str(tmp_path / "g.md")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "CUDA is unavailable" in proc.stderr and "--cpu" in proc.stderr
    assert not (tmp_path / "g.md").exists()


def test_gpu_smoke_cpu_fallback_runs_without_ray_and_is_lossless(tmp_path):
    out = tmp_path / "gpu.md"
    code = ("import runpy, sys\n"
            + "".join(f"sys.modules[{name!r}] = None\n" for name in BLOCKED)  # `import ray` raises ImportError
            + f"sys.argv = ['gpu_smoke.py', '--cpu', '--out', {str(out)!r}]\n"
            + f"runpy.run_path({str(REPO / 'benchmarks' / 'gpu' / 'gpu_smoke.py')!r}, run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["environment"]["fallback"] and "CPU fallback" in out.read_text()
    lossless = results["lossless_fp32"]
    assert lossless["equal_plain"] and lossless["equal_hf"] and lossless["accepted"] > 0
    assert lossless["prompts"] == 16 and lossless["prompt_lengths"] == [8, 300]  # the ragged batch
    assert lossless["sampled_match"] == 1.0 and lossless["sampled_accepted"] > 0 and lossless["uniforms_equal_cpu"]
    assert [m["shape"] for m in results["bf16"]] == ["SmolLM2-135M (shrunk)", "Llama-3-8B-Instruct (shrunk)"]
    assert all(0.0 <= m["match_rate"] <= 1.0 for m in results["bf16"])
    assert results["bf16"][0]["accepted"] > 0  # the fp32 target's head drafts for its bf16 cast too
    rows = results["timing"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["spec"]["tokens"] == r["plain"]["tokens"] for r in rows)
    assert all(r["spec"]["tau"] > 1.0 for r in rows)  # timed decodes accept drafts (tau 1.00 on the H200 once)
    assert results["timing"]["trees"] and all(t["verify_ms_per_step"] > 0 for t in results["timing"]["trees"])
    agreement = results["forward_agreement"]  # fast vs transformers' forward on one tree batch
    assert [(a["shape"], a["dtype"]) for a in agreement] == [("SmolLM2", "bfloat16"), ("SmolLM2", "float16"),
                                                             ("Llama-3-8B", "bfloat16")]
    for a in agreement:  # as close to float64 as transformers' own forward in that dtype (x2 for fused sums)
        assert a["max_abs_fast_vs_f64"] <= 2 * a["max_abs_hf_vs_f64"] + 1e-3 and a["argmax_agree"] > 0.95
    profile = results["timing"]["profile"]
    assert profile["steps"] > 1 and profile["per_step"] > 0 and profile["attention_kernels"]
    assert profile["host_ops"] and all(h["calls_per_step"] > 0 for h in profile["host_ops"])
    memory = results["timing"]["memory"]  # the plan's figure for the paper's replay sessions, at the small shape
    assert memory["predicted_gb"] > 0 and memory["sessions"] * memory["rows"] >= 4
    compiled = results["compiled"]  # the compiled fast forward: skipped only where inductor cannot run here
    assert "skipped" in compiled or (compiled["equal_eager"] and compiled["equal_hf"] and compiled["accepted"] > 0)
    assert "skipped" in compiled or [r["batch"] for r in compiled["rows"]] == [1, 2]
