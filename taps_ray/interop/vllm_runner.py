"""Runs in vLLM's side venv (`make vllm-venv`), never imported by the project: one vLLM `LLM` decodes given prompt
ids greedily, one prompt at a time (batch 1, as `taps bench` decodes) or in groups submitted together (`batches`,
benchmarks/peers/batch_throughput.py), and writes the outputs, seconds and vLLM's speculative-decoding counters per group
to a JSON file.

    <side venv>/bin/python vllm_runner.py request.json result.json

request: {"target": folder, "dtype": "float32"|"bfloat16", "prompts": [[ids]], "max_new_tokens": n,
"stop_token_ids": [ids], "speculative_config": {...} | null, "repetitions": r, "max_model_len": n,
"enforce_eager": bool, "batches": [b, ...] (optional, default [1])}. It imports nothing of taps_ray: the side venv has vLLM's transformers, not the project's.
vLLM's engine runs in a process it spawns, hence the `__main__` guard. The CPU settings (VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND, LD_PRELOAD) come from the environment the caller sets (taps_ray/interop/side.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_metrics(metrics: list) -> dict:
    """vLLM's spec-decode counters from `LLM.get_metrics()` (summed over label sets), and the accepted tokens per
    draft position."""
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            out[metric.name] += int(metric.value)
        elif metric.name == PER_POSITION:
            values = [int(v) for v in metric.values]
            per_pos = [a + b for a, b in zip(per_pos, values)] if per_pos else values
    out[PER_POSITION] = per_pos
    return out


def run(request: dict) -> dict:
    """`request["batches"]` (default [1]): the concurrencies to decode at, each over all the prompts in groups of
    that many submitted together (max_num_seqs = the largest); the top-level results are the first's."""
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    batches = request.get("batches", [1])
    started = time.perf_counter()
    llm = LLM(model=request["target"], tokenizer=request["target"], dtype=request["dtype"], seed=0,
              max_model_len=request["max_model_len"], max_num_seqs=max(batches),
              enforce_eager=request["enforce_eager"], speculative_config=request["speculative_config"],
              disable_log_stats=False)
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                            stop_token_ids=request["stop_token_ids"], ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, not counted in the timings or counters
    by_batch = {batch: _decode(llm, prompts, params, batch, request["repetitions"]) for batch in batches}
    return {"vllm_version": __version__, "startup_s": startup_s, **by_batch[batches[0]],
            "by_batch": {str(batch): result for batch, result in by_batch.items()}}


def _decode(llm, prompts: list, params, batch: int, repetitions: int) -> dict:
    """The prompts in groups of `batch` submitted together: per prompt the outputs (first repetition), per group
    the seconds (summed over repetitions) and the counters' increase (first repetition)."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    tokens: list[list[int]] = []
    counters: list[dict] = []
    seconds = [0.0] * len(groups)
    for repetition in range(repetitions):
        for i, group in enumerate(groups):
            before = spec_metrics(llm.get_metrics()) if repetition == 0 else None
            start = time.perf_counter()
            outs = llm.generate(group, params, use_tqdm=False)
            seconds[i] += time.perf_counter() - start
            if before is not None:
                tokens.extend(list(out.outputs[0].token_ids) for out in outs)
                counters.append(_increase(before, spec_metrics(llm.get_metrics())))
    return {"tokens": tokens, "seconds": seconds, "counters": counters}


def _increase(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    old = before[PER_POSITION] or [0] * len(after[PER_POSITION])
    out[PER_POSITION] = [a - b for a, b in zip(after[PER_POSITION], old)]
    return out


def main(argv: list[str]) -> int:
    request_file, result_file = (Path(a) for a in argv)
    result = run(json.loads(request_file.read_text()))
    with tempfile.NamedTemporaryFile("w", dir=result_file.parent, delete=False, suffix=".tmp") as handle:
        json.dump(result, handle)
    os.replace(handle.name, result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
