#!/usr/bin/env bash
# GPU smoke test, one command on a fresh CUDA machine (Python 3.11, this repository, PyPI reachable):
#
#     bash benchmarks/gpu_smoke.sh
#
# 1. setup as `make install` does (torch 2.13.0 resolves to the CUDA build on Linux; everything else pinned
#    by constraints.txt), into .venv unless it exists;
# 2. the engine and lossless tests (greedy and sampled decoding, every combination, SmolLM2 fp32), which run
#    on every available device, CUDA included;
# 3. the greedy lossless check in fp32 and bf16 on CUDA: speculative decoding == the target's own greedy;
# 4. the quick tiny sweep on Ray with the actors and trials given a share of the GPU;
# 5. `taps bench` on CUDA (bf16) with tiny budgets;
# and writes reports/gpu.md (GPU name, torch/CUDA versions, test counts, the sweep's tau table, bench tokens/s).
# Budget: under 8 minutes on an H200, setup included. It stops at once, saying so, where there is no CUDA GPU.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PYTHON="${PYTHON:-python3.11}"
OUT="${GPU_SMOKE_DIR:-$REPO/runs/gpu-smoke}"
REPORT="$REPO/reports/gpu.md"
mkdir -p "$OUT" "$REPO/reports"

fail() { echo "gpu_smoke: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null 2>&1 || fail "no CUDA GPU here (nvidia-smi not found); run this on a machine with an NVIDIA GPU"
nvidia-smi -L >/dev/null 2>&1 || fail "no CUDA GPU here (nvidia-smi -L failed: no driver or no device)"
command -v "$PYTHON" >/dev/null 2>&1 || fail "$PYTHON not found; set PYTHON=/path/to/python3.11"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export TAPS_DATA_DIR="${TAPS_DATA_DIR:-$(make -s --no-print-directory print-data-dir)}"  # the Makefile owns the default

# --- 1. setup ---------------------------------------------------------------------------------------------------
start=$SECONDS
if [ ! -x .venv/bin/python ]; then "$PYTHON" -m venv .venv; fi
PY="$REPO/.venv/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -c constraints.txt torch==2.13.0
"$PY" -m pip install -q -c constraints.txt -e .
"$PY" -m pip install -q -c constraints.txt -r requirements-test.txt
"$PY" -m pip install -q --no-deps -r requirements-offline.txt
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || fail "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA device: a CPU build of torch, or a driver too old for it"
echo "gpu_smoke: setup $((SECONDS - start))s"

# --- 2. engine and lossless tests (every available device) -------------------------------------------------------
start=$SECONDS
set +e
"$PY" -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_combine.py --junitxml="$OUT/tests.xml" \
  > "$OUT/tests.log" 2>&1
TESTS_RC=$?
set -e
tail -3 "$OUT/tests.log"
echo "gpu_smoke: tests $((SECONDS - start))s (exit $TESTS_RC)"

# --- 3. greedy lossless on CUDA in fp32 and bf16 ------------------------------------------------------------------
start=$SECONDS
set +e
"$PY" - "$OUT/lossless.json" > "$OUT/lossless.log" 2>&1 <<'EOF'
"""Speculative greedy decoding on CUDA against HF greedy on CUDA (SmolLM2-135M, a random head, 32 tokens).

fp32 must match exactly. bf16 is reported: a bf16 forward over a tree and one over a single token may round a
near-tie of the top two logits apart, so a divergence there is a numerics finding, not an engine bug.
"""
import json, sys
import torch
from taps_ray.config import TargetConfig, TreeConfig
from taps_ray.models.draft_head import new_head
from taps_ray.models.target import load_target
from taps_ray.decoding.generate import generate
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.tree import DraftContext
from taps_ray.decoding.verify import SamplingParams

QUESTIONS = ("What is 15 + 27? Answer briefly.", "Name three colours.", "Write one sentence about rain.")
out = {}
for dtype in ("float32", "bfloat16"):
    target = load_target(TargetConfig(name="smollm2-135m-instruct", dtype=dtype))
    target.model.to("cuda")
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for q in QUESTIONS]
    head = new_head(target.model.config, getattr(torch, dtype), seed=1).to("cuda")
    context = DraftContext(target.model.get_input_embeddings(), target.model.lm_head)
    proposer = SingleHead("random", head, context, TreeConfig(total_token=8, depth=3, top_k=3))
    spec = generate(target.model, proposer, prompts, SamplingParams(), 32, target.stop_token_ids)
    firsts = []
    for prompt, generation in zip(prompts, spec):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                        eos_token_id=target.stop_token_ids, pad_token_id=0)[0, len(prompt):].tolist()
        mine = generation.tokens
        firsts.append(next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b),
                           None if len(mine) == len(ref) else min(len(mine), len(ref))))
    out[dtype] = {"prompts": len(prompts), "identical": firsts.count(None), "first_divergence": firsts,
                  "device": str(next(target.model.parameters()).device)}
    print(dtype, out[dtype])
json.dump(out, open(sys.argv[1], "w"))
sys.exit(0 if out["float32"]["identical"] == out["float32"]["prompts"] else 1)
EOF
LOSSLESS_RC=$?
set -e
tail -3 "$OUT/lossless.log"
echo "gpu_smoke: lossless fp32/bf16 $((SECONDS - start))s (exit $LOSSLESS_RC)"

# --- 4. the quick tiny sweep on Ray, actors and trials on the GPU ----------------------------------------------------
start=$SECONDS
"$PY" - "$OUT/tiny-gpu.yaml" "$OUT/sweep" <<'EOF'
"""configs/tiny.yaml with each target worker, drafter, features task and trial given a quarter of the GPU,
and the quick version of it for `taps bench`."""
import sys
import yaml
from taps_ray.study.sweep import absolute_paths, quick_config
from taps_ray.config import TargetConfig, parse_config

data = yaml.safe_load(open("configs/tiny.yaml"))
data["ray"].update(num_cpus=None, target_num_gpus=0.25, drafter_num_gpus=0.25, trial_gpus=0.25, trial_cpus=1)
if "device" in TargetConfig.model_fields:
    data["target"]["device"] = "cuda"
data["work_dir"] = sys.argv[2]
data["reports_dir"] = sys.argv[2] + "/reports"
yaml.safe_dump(data, open(sys.argv[1], "w"))
quick = quick_config(absolute_paths(parse_config(data, sys.argv[1])))  # what --quick runs: `taps bench` reads its heads
yaml.safe_dump(quick.model_dump(mode="json"), open(sys.argv[1].replace(".yaml", "-quick.yaml"), "w"))
EOF
set +e
"$PY" jobs/sweep.py --config "$OUT/tiny-gpu.yaml" --quick --stages data,features,train,eval > "$OUT/sweep.log" 2>&1
SWEEP_RC=$?
set -e
tail -3 "$OUT/sweep.log"
echo "gpu_smoke: tiny sweep $((SECONDS - start))s (exit $SWEEP_RC)"

# --- 5. taps bench on CUDA, bf16, tiny budgets (the heads the sweep trained) ------------------------------------------
start=$SECONDS
set +e
"$PY" -m taps_ray.cli bench --config "$OUT/tiny-gpu-quick.yaml" --dtype bf16 --per-benchmark 2 --max-new-tokens 32 \
  --repetitions 1 --proposers math --no-peers --name gpu_bench > "$OUT/bench.log" 2>&1
BENCH_RC=$?
set -e
tail -3 "$OUT/bench.log"
echo "gpu_smoke: bench $((SECONDS - start))s (exit $BENCH_RC)"

# --- report ----------------------------------------------------------------------------------------------------------
"$PY" - "$OUT" "$REPORT" "$TESTS_RC" "$LOSSLESS_RC" "$SWEEP_RC" "$BENCH_RC" <<'EOF'
"""reports/gpu.md from what the steps above left in the output folder."""
import json, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import torch

out, report = Path(sys.argv[1]), Path(sys.argv[2])
tests_rc, lossless_rc, sweep_rc, bench_rc = (int(x) for x in sys.argv[3:7])


def table(frame: pd.DataFrame) -> str:
    head = "| " + " | ".join(map(str, frame.columns)) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "".join("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |\n"
                          for row in frame.itertuples(index=False))


gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
lines = [f"# GPU smoke test ({time.strftime('%Y-%m-%d')})", "", "`bash benchmarks/gpu_smoke.sh` on:", "",
         f"* GPU: {gpu}", f"* torch {torch.__version__}, CUDA {torch.version.cuda}, "
         f"cuDNN {torch.backends.cudnn.version()}", ""]
try:
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines += ["## Engine and lossless tests (tests/test_engine.py, tests/test_combine.py)", "",
              f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
              f"(exit {tests_rc}).", ""]
except (OSError, ET.ParseError) as error:
    lines += ["## Engine and lossless tests", "", f"no results: {error} (exit {tests_rc})", ""]
lossless = json.loads((out / "lossless.json").read_text()) if (out / "lossless.json").is_file() else {}
lines += ["## Greedy lossless on CUDA (SmolLM2-135M, random head, 32 new tokens)", ""]
lines += [f"* {dtype}: {v['identical']}/{v['prompts']} prompts identical to HF greedy on {v['device']} "
          f"(first divergence per prompt: {v['first_divergence']})" for dtype, v in lossless.items()] or [f"* did not run (exit {lossless_rc}); see lossless.log"]
lines += [""]
summary_path = out / "sweep-quick" / "results" / "summary.parquet"
lines += ["## Quick tiny sweep on Ray (random tiny Llama target, GPU shares)", ""]
if summary_path.is_file():
    summary = pd.read_parquet(summary_path)
    cols = [c for c in ("head_kind", "proposer", "benchmark", "temperature", "tau", "tau_taps", "tokens_per_s") if c in summary]
    lines += [f"exit {sweep_rc}; tau per cell:", "", table(summary[cols].sort_values(cols[:4]))]
else:
    lines += [f"no results (exit {sweep_rc}); see sweep.log", ""]
bench_md = out / "sweep-quick" / "reports" / "gpu_bench.md"
lines += ["## taps bench on CUDA (bf16, tiny budgets)", ""]
lines += [bench_md.read_text() if bench_md.is_file() else f"no report (exit {bench_rc}); see bench.log", ""]
report.write_text("\n".join(lines))
print(f"wrote {report}")
EOF
[ "$TESTS_RC$LOSSLESS_RC$SWEEP_RC$BENCH_RC" = "0000" ] || fail "some steps failed (tests $TESTS_RC, lossless $LOSSLESS_RC, sweep $SWEEP_RC, bench $BENCH_RC); see $OUT and $REPORT"
echo "gpu_smoke: all passed; $REPORT"
