"""The speculative decoding loop over a batch of sequences, with per-step records.

`run_loop` prefills through a `Verifier`, then runs `step.decode_step` (draft, verify in one batched call, accept,
commit) until every sequence is finished. The verifier is the in-process `TargetBatch`, a Ray target worker's
session (`study.actors.WorkerVerifier`) or recorded greedy traces (`replay.TraceVerifier`), so a live cell, a
drafter actor's cell and a replayed cell step the same way. Plain decoding is the same loop with `PlainDecoding`,
so every speedup compares like with like.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

import torch

from taps_ray.decoding.draft_gate import DraftGate
from taps_ray.decoding.step import Decoding, Drafting, Generation, Verifier, decode_step
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposer import Proposer

if TYPE_CHECKING:  # an annotation only: importing the class loads transformers' model code (a drafter imports this)
    from transformers import PreTrainedModel


def fresh_seeds(count: int) -> list[int]:
    """Seeds for sequences the caller gave none: from the OS's randomness, untouched by any seeding of `random` or
    torch, so two calls never share draws by accident (the old default, seed b for row b, made every T > 0 call
    return the same text)."""
    return [secrets.randbits(63) for _ in range(count)]


@torch.no_grad()
def run_loop(
    verifier: Verifier,
    proposer: Proposer | list[Proposer],
    prompts: list[list[int]],
    params: SamplingParams,
    max_new_tokens: int | list[int],
    stop_ids: list[int],
    seeds: list[int] | None = None,
    draft_below: int | None = None,
) -> list[Generation]:
    """Decode every prompt to a stop token or `max_new_tokens` (one for all, or one per prompt); sequence b
    samples with its own seed and drafts with `proposer` (one for all, or one per prompt: replay's per-trace
    drafters). A sequence leaves the batched forward as soon as it is finished.

    `draft_below`: draft only while fewer sequences than this are unfinished; otherwise a step verifies just the
    root (plain decoding, still lossless; `step.decode_step` keeps the paused proposers' context whole).
    `seeds` None: every sequence gets a fresh random seed (`fresh_seeds`), so T > 0 output differs from call to
    call; each `Generation.seed` says the seed it used, and passing those back repeats the run token for token.
    """
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or min(budgets, default=1) < 1:
        raise ValueError(f"max_new_tokens must be at least 1, one for all prompts or one per prompt: {max_new_tokens}")
    proposers = list(proposer) if isinstance(proposer, list) else [proposer] * len(prompts)
    if len(proposers) != len(prompts):
        raise ValueError(f"got {len(proposers)} proposers for {len(prompts)} prompts: pass one for all or one each")
    gate = DraftGate(draft_below)
    seeds = list(seeds) if seeds is not None else fresh_seeds(len(prompts))
    stops = set(stop_ids)
    start = time.perf_counter()
    started = verifier.start(prompts, params, seeds)
    prefill_s = time.perf_counter() - start

    sequences = [
        Decoding(Generation(prompt=list(prompt), prefill_s=prefill_s, seed=seed), Drafting(p, p.init_state()), budget,
                 stops)
        for prompt, p, budget, seed in zip(prompts, proposers, budgets, seeds, strict=True)
    ]
    for seq, committed in zip(sequences, started, strict=True):
        seq.extend(committed)
    while any(not seq.generation.finished_by for seq in sequences):
        live = sum(not seq.generation.finished_by for seq in sequences)
        decode_step(sequences, verifier.step, gate.drafts(live))
    wall = time.perf_counter() - start
    generations = [seq.generation for seq in sequences]
    for generation in generations:
        generation.wall_s = wall
    return generations


def generate(
    model: PreTrainedModel,
    proposer: Proposer,
    prompts: list[list[int]],
    params: SamplingParams,
    max_new_tokens: int,
    stop_ids: list[int],
    seeds: list[int] | None = None,
) -> list[Generation]:
    """In-process decoding: one `TargetBatch` verifies every sequence's tree in one forward per step."""
    batch = TargetBatch(model, feature_layers=proposer.feature_layers)
    return run_loop(batch, proposer, prompts, params, max_new_tokens, stop_ids, seeds)
