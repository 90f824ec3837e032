"""Serve's engine without Serve: the replica's `ContinuousBatcher` under a closed loop, in a process of its own with
the replica's torch threads, OpenMP wait setting and target forward (on a CPU under `target.compile: auto`, the
layer graph, warmed up as the replica warms it), for `serve_vs_vllm.py --engine-alone`. Not a test.

Why: vLLM's client times the whole served path, engine and serving stack together. This row times the engine
alone on the same prompts, concurrency and dtype, in the same run, so a report shows how much of a served gap is
the engine and how much is what serving adds around it (on a 2-core machine, the proxy, Ray's processes and the
client run on the cores the replica's compute threads use). It is taps' own timer
(`taps_ray.bench.closed_loop`): TTFT from a request's submission, ITL per token of each later step; no TPOT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(config_path: str, dtype: str, threads: int, max_seqs: int, concurrencies: list[int], prompts: int,
        max_tokens: int) -> list[dict]:
    """One closed loop per concurrency, in a child process; each a row of `serve_vs_vllm.summary`'s fields."""
    from taps_ray.config import load_config
    from taps_ray.ray_runtime import OMP_WAIT_ENV, process_runtime_env

    replica = process_runtime_env(OMP_WAIT_ENV[load_config(config_path).serve.replica_omp_wait])["env_vars"]
    env = {**os.environ, **replica, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    request = {"config": config_path, "dtype": dtype, "threads": threads, "max_seqs": max_seqs,
               "concurrencies": concurrencies, "prompts": prompts, "max_tokens": max_tokens}
    done = subprocess.run([sys.executable, __file__, json.dumps(request)], env=env, capture_output=True, text=True,
                          timeout=1800, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the engine-alone loop failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(request: dict) -> list[dict]:
    """In this process: load the target on a compute thread with the replica's threads (as a replica does,
    `compute_thread`), warm it up, then one closed loop per concurrency."""
    from taps_ray.compute_thread import compute_executor

    return compute_executor("taps-decode", request["threads"]).submit(_loops, request).result()


def _loops(request: dict) -> list[dict]:
    from taps_ray.bench.closed_loop import closed_loop, mixed_prompts, percentile
    from taps_ray.config import load_config
    from taps_ray.decoding.continuous import ContinuousBatcher
    from taps_ray.drafting.proposers import PlainDecoding
    from taps_ray.models.target import load_target
    from taps_ray.serve.warm_up import warm_up

    config = load_config(request["config"])
    target = load_target(config.target, request["dtype"], serving=True)  # the replica's forward, compiled or not
    prompts = mixed_prompts(config, target.tokenizer, request["prompts"])

    def batcher() -> ContinuousBatcher:
        return ContinuousBatcher(target.model, target.stop_token_ids, request["max_seqs"],
                                 prefill_tokens=config.serve.prefill_tokens)

    warm_up(batcher(), PlainDecoding(), prompts[0])  # as the replica does before it serves
    closed_loop(batcher(), prompts[:4], PlainDecoding(), 4, 8)  # warm-up: oneDNN's first calls, the allocator
    rows = []
    for concurrency in request["concurrencies"]:
        times = closed_loop(batcher(), prompts, PlainDecoding(), concurrency, request["max_tokens"])
        row = {"output_tok_s": times.tokens / times.wall_s, "completed": len(prompts), "failed": 0,
               "output_tokens": times.tokens, "tpot_p50_ms": float("nan"), "tpot_p99_ms": float("nan")}
        for metric, values in (("ttft", times.first), ("itl", times.gaps)):
            for name, q in (("p50", 0.5), ("p99", 0.99)):
                row[f"{metric}_{name}_ms"] = 1000 * percentile(values, q)
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(measure(json.loads(sys.argv[1]))))
