"""Bytes per verification step between a drafter actor and its target worker, measured on SmolLM2.

What crosses the wire is exactly what `study/actors.py` sends: a session start (prompts in, each sequence's
first `Committed` out) and, per step, the session's draft trees in (`WorkerVerifier.step`) and its `Committed`
results out (`TargetWorker.step`), all as CPU tensors. This script runs the real loop (`run_loop`) on the real
SmolLM2 target with a `Verifier` that pickles those very messages (protocol 5, as Ray does) and counts bytes,
then projects them to Llama-3-8B: tree bytes depend only on the tree shape; a result carries one target
feature row (hidden size x dtype bytes) per committed token, and a start one per prompt token.

    PYTHONPATH=. HF_HUB_OFFLINE=1 TAPS_DATA_DIR=<data> python benchmarks/speed/step_bytes.py --config configs/paper.yaml

The draft head is random (no trained head is needed to count bytes): it fixes the tree shape, which is the
config's, but accepts few drafts, so the measured results carry ~1 feature row per sequence; the projection
states the figure per committed token so any acceptance length can be read off.
"""

from __future__ import annotations

import argparse
import pickle
import statistics

import torch

from taps_ray.config import TargetConfig, load_config
from taps_ray.data.chat import build_prompt_ids
from taps_ray.data.sources import load_questions
from taps_ray.models.draft_head import new_head
from taps_ray.models.target import load_target
from taps_ray.decoding.generate import run_loop
from taps_ray.drafting.proposers import SingleHead
from taps_ray.decoding.target_batch import Committed, TargetBatch, results_to
from taps_ray.drafting.eagle2 import DraftContext
from taps_ray.drafting.tree import DraftTree, trees_to
from taps_ray.decoding.verify import SamplingParams

LLAMA3_8B_HIDDEN = 4096
LLAMA3_8B_BYTES = 2  # configs/paper.yaml runs the target in float16


def wire(message: object) -> int:
    return len(pickle.dumps(message, protocol=5))


class CountingVerifier:
    """The engine's `Verifier` over an in-process `TargetBatch`, counting the bytes the Ray path would ship."""

    def __init__(self, batch: TargetBatch) -> None:
        self.batch = batch
        self.start_in = self.start_out = 0
        self.steps: list[dict[str, int]] = []

    def start(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Committed]:
        committed = self.batch.start(prompts, params, seeds)
        self.start_in = wire((prompts, params, seeds, "drafter-0"))
        self.start_out = wire(("s0", results_to(committed, "cpu")))
        return committed

    def step(self, trees: list[DraftTree | None]) -> list[Committed | None]:
        results = self.batch.step(trees)
        live = [r for r in results if r is not None]
        self.steps.append({
            "in": wire(("s0", trees_to(trees, "cpu"))),  # what WorkerVerifier and TargetWorker ship
            "out": wire(results_to(results, "cpu")),
            "sequences": len(live),
            "committed": sum(len(r.tokens) for r in live),
            "tree_nodes": sum(t.size for t in trees if t is not None),
        })
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/paper.yaml", help="tree shape and session size come from here")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=8, help="new tokens per sequence (at least this many steps' worth)")
    parser.add_argument("--benchmark", default="svamp")
    args = parser.parse_args()

    cfg = load_config(args.config)
    target = load_target(TargetConfig(name="smollm2-135m-instruct", dtype=args.dtype))
    questions = load_questions(args.benchmark, cfg.resolved_data_dir(), limit=cfg.eval.batch_size)
    prompts = [build_prompt_ids(target.tokenizer, q.turns[:1], [], cfg.eval.system_prompt) for q in questions]
    head = new_head(target.model.config, target.dtype, seed=0, device=target.device)
    context = DraftContext(target.model.get_input_embeddings(), target.model.lm_head)
    proposer = SingleHead("random", head, context, cfg.tree)
    verifier = CountingVerifier(TargetBatch(target.model))
    run_loop(verifier, proposer, prompts, SamplingParams(), args.steps, [])

    hidden = target.model.config.hidden_size
    elem = torch.finfo(target.dtype).bits // 8
    steps = verifier.steps
    seqs = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    tree_in = statistics.mean(s["in"] for s in steps)
    out = statistics.mean(s["out"] for s in steps)
    rows = statistics.mean(s["committed"] for s in steps)
    # a result = fixed framing + one feature row per committed token; the projection swaps the row size
    framing_out = out - rows * hidden * elem
    framing_start = verifier.start_out - prompt_tokens * hidden * elem
    row_8b = LLAMA3_8B_HIDDEN * LLAMA3_8B_BYTES
    tree = cfg.tree
    print(f"# Bytes per step, SmolLM2-135M ({args.dtype}, hidden {hidden}, device {target.device}), "
          f"{seqs} sequences per session, tree {tree.total_token}/{tree.depth}/{tree.top_k} from {args.config}, "
          f"{len(steps)} steps")
    print()
    print("| message | SmolLM2 measured | per sequence | Llama-3-8B projected (fp16, hidden 4096) |")
    print("|---|---|---|---|")
    print(f"| start in: prompts ({prompt_tokens} tokens) | {verifier.start_in:,} B | {verifier.start_in / seqs:,.0f} B "
          f"| same: {verifier.start_in:,} B (token ids only) |")
    start_8b = framing_start + prompt_tokens * row_8b
    print(f"| start out: first Committed (prompt features) | {verifier.start_out:,} B | "
          f"{verifier.start_out / seqs:,.0f} B | {start_8b:,.0f} B ({prompt_tokens} x 4096 x 2 B + framing) |")
    print(f"| step in: trees ({statistics.mean(s['tree_nodes'] for s in steps):.0f} nodes) | {tree_in:,.0f} B | "
          f"{tree_in / seqs:,.0f} B | same: {tree_in:,.0f} B (tree shape only) |")
    out_8b = framing_out + rows * row_8b
    print(f"| step out: Committed ({rows:.1f} tokens committed) | {out:,.0f} B | {out / seqs:,.0f} B | "
          f"{out_8b:,.0f} B |")
    print(f"| step out, per committed token | {hidden * elem:,} B | | {row_8b:,} B |")
    print()
    print(f"Fixed framing of a step's results: {framing_out:,.0f} B per session ({framing_out / seqs:,.0f} B per "
          f"sequence: verdict lists, token ids, pickle headers).")


if __name__ == "__main__":
    main()
