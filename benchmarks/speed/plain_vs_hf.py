#!/usr/bin/env python
"""Our plain loop (and the head-free proposers) against HF `generate` in one process, on the same prompts.

    python benchmarks/speed/plain_vs_hf.py --prompts 4 --max-new-tokens 64 --repetitions 2

SmolLM2-135M-Instruct in fp32, batch 1, T=0. Methods are interleaved (the order rotates every repetition) so
a noisy machine slows them alike; every output is checked against HF greedy's. Prints tokens/s and the ratio
to HF greedy of each method. Not a test; a quick check that the plain loop keeps level with HF greedy and what
prompt lookup (ours and HF's) gains without a trained head.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from taps_ray.bench.interleaved import time_interleaved  # noqa: E402
from taps_ray.config import TargetConfig, TreeConfig  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402
from taps_ray.decoding.generate import run_loop  # noqa: E402
from taps_ray.drafting.registry import build_proposer  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "A train travels 60 km per hour for 3 hours, then 40 km per hour for 2 hours. How far does it travel?",
    "List three ways to save energy at home.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["hf-greedy", "plain"],
                        help="hf-greedy, hf-prompt-lookup, and any proposer that needs no trained head (plain, ngram)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig(name="smollm2-135m-instruct", dtype="float32"))
    tok, model, stops = target.tokenizer, target.model, target.stop_token_ids
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)["input_ids"]
        for q in QUESTIONS[: args.prompts]
    ]

    def hf(**options):
        def run(prompt: list[int]) -> list[int]:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_token_id, **options)
            return out[0, len(prompt):].tolist()
        return run

    def ours(name: str):
        proposer = build_proposer(name, target, {}, TreeConfig())

        def run(prompt: list[int]) -> list[int]:
            return run_loop(TargetBatch(model), proposer, [prompt], SamplingParams(), args.max_new_tokens, stops)[0].tokens
        return run

    peers = {"hf-greedy": hf(), "hf-prompt-lookup": hf(prompt_lookup_num_tokens=10)}
    methods = {m: peers[m] if m in peers else ours(m) for m in dict.fromkeys(["hf-greedy", *args.methods])}
    names = list(methods)
    speeds, outputs = time_interleaved(methods, prompts, args.repetitions)
    base = speeds["hf-greedy"]
    print(f"{len(prompts)} prompts x {args.repetitions} repetitions, {args.max_new_tokens} new tokens, "
          f"{args.threads} threads, SmolLM2-135M fp32, batch 1, T=0")
    print(f"{'method':<18} {'tokens/s':>9} {'vs hf-greedy':>13} {'identical':>10}")
    for name in names:
        speed = speeds[name]
        same = sum(a == b for a, b in zip(outputs[name], outputs["hf-greedy"]))
        print(f"{name:<18} {speed:9.2f} {speed / base:12.3f}x {same:>6}/{len(prompts)}")


if __name__ == "__main__":
    main()
