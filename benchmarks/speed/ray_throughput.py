#!/usr/bin/env python
"""Throughput of the Ray path: batched verification (TargetBatch.step at batch 1, 2, 4, 8) and evaluation
through Ray actors vs in-process on the same cells. Writes reports/ray_throughput.md. Not a test.

    python benchmarks/speed/ray_throughput.py --config configs/cpu.yaml

Heads: the trained heads of the config's work dir when they exist, random heads otherwise (acceptance then is
near zero; verification throughput does not depend on it, and the evaluation comparison becomes a worst case
for Ray: one round trip per committed token).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from taps_ray.config import StudyConfig, load_config  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _heads_config(cfg: StudyConfig, kind: str, target, scratch: Path) -> tuple[StudyConfig, str]:
    """The first two heads (what the single-head and routed proposers use): trained ones when the config's work
    dir has them, else random heads in a scratch work dir."""
    from taps_ray.models.draft_head import new_head
    from taps_ray.workdir import head_checkpoint

    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"mixtures": cfg.train.mixtures[:2]})})
    if all((head_checkpoint(cfg, kind, m) / "model.safetensors").is_file() for m in cfg.train.mixtures):
        return cfg, f"trained `{kind}` heads ({', '.join(cfg.train.mixtures)}) from `{cfg.work_dir}`"
    random_cfg = cfg.model_copy(update={"work_dir": str(scratch)})
    for seed, mixture in enumerate(cfg.train.mixtures, start=1):
        head = new_head(target.model.config, seed=seed, kind=kind, trained_on=mixture)
        head.save(head_checkpoint(random_cfg, kind, mixture))
    return random_cfg, f"random `{kind}` heads (no trained heads in `{cfg.work_dir}` yet)"


def _prompts(cfg: StudyConfig, target, n: int) -> list[list[int]]:
    from taps_ray.data.chat import build_prompt_ids
    from taps_ray.data.sources import load_questions

    questions = load_questions("gsm8k", cfg.resolved_data_dir(), limit=n)
    return [build_prompt_ids(target.tokenizer, q.turns[:1], [], cfg.eval.system_prompt) for q in questions]


class _TimedSteps:
    """The engine's `Verifier` over an in-process `TargetBatch`, timing `TargetBatch.step` at every step that
    verifies all `size` sequences of the batch (one that has finished leaves the loop's forward)."""

    def __init__(self, batch, size: int) -> None:
        self.batch, self.size = batch, size
        self.steps: list[tuple[float, int, int]] = []  # per full step: seconds, tree tokens, committed tokens

    def start(self, prompts, params, seeds):
        return self.batch.start(prompts, params, seeds)

    def step(self, trees):
        start = time.perf_counter()
        committed = self.batch.step(trees)
        elapsed = time.perf_counter() - start
        live = [t for t in trees if t is not None]
        if len(live) == self.size:
            self.steps.append((elapsed, sum(t.size for t in live),
                               sum(len(c.tokens) for c in committed if c is not None)))
        return committed


def verification(cfg: StudyConfig, target, heads_cfg: StudyConfig, kind: str, batches: list[int], steps: int,
                 repeats: int) -> list[dict]:
    """Tree tokens verified per second by TargetBatch.step inside the engine's loop (`run_loop`), trees drafted
    (untimed) by the first head."""
    from taps_ray.decoding.generate import run_loop
    from taps_ray.drafting.setup import load_proposers
    from taps_ray.decoding.target_batch import TargetBatch
    from taps_ray.decoding.verify import SamplingParams

    name = heads_cfg.train.mixtures[0]
    proposer = load_proposers(heads_cfg, [name], target=target, kind=kind)[name]
    prompts = _prompts(cfg, target, max(batches))
    params = SamplingParams(temperature=0.0)
    rows = []
    for size in batches:
        runs = []
        for _ in range(repeats):
            verifier = _TimedSteps(TargetBatch(target.model, feature_layers=proposer.feature_layers), size)
            # steps + 2 new tokens (the prefill samples the first): steps + 1 steps while no draft is accepted
            # (random heads), fewer full-batch steps when drafts are; step 0 warms up
            run_loop(verifier, proposer, prompts[:size], params, steps + 2, stop_ids=[])
            timed = verifier.steps[1 : steps + 1]
            if not timed:
                raise RuntimeError(f"batch {size}: no step after the warm-up verified the whole batch; "
                                   "raise --verify-steps")
            runs.append(tuple(map(sum, zip(*timed))) + (len(timed),))
        seconds, tree_tokens, new_tokens, timed_steps = min(runs)  # the least disturbed run
        rows.append(
            {
                "batch": size,
                "tree": cfg.tree.total_token,
                "step_ms": 1000 * seconds / timed_steps,
                "tree_tokens_per_s": tree_tokens / seconds,
                "sequence_steps_per_s": size * timed_steps / seconds,
                "committed_tokens_per_s": new_tokens / seconds,
                "timed_steps": timed_steps,
                "all_runs_s": [round(r[0], 3) for r in runs],
            }
        )
        print(f"verify batch {size}: {rows[-1]['step_ms']:.1f} ms/step, {rows[-1]['tree_tokens_per_s']:.0f} tree tokens/s", flush=True)
    return rows


def evaluation(cfg: StudyConfig, target, heads_cfg: StudyConfig, kind: str, proposers: list[str], repeats: int,
               drafters: list[int]) -> dict:
    """The same cells in-process (run_cell) and through Ray actors (EvalPool); tokens/s and equality."""
    import pandas as pd
    import ray

    from taps_ray.drafting.setup import load_heads
    from taps_ray.eval.cell import Cell
    from taps_ray.eval.runner import run_cell
    from taps_ray.eval.store import ResultsStore
    from taps_ray.ray_runtime import start_ray
    from taps_ray.study.actors import pack_heads
    from taps_ray.study.eval_pool import EvalPool

    cells = [Cell(kind, p, b, t) for p in proposers for b in cfg.eval.benchmarks for t in cfg.eval.temperatures]
    heads = load_heads(heads_cfg, kind, target.dtype)
    threads = torch.get_num_threads()
    results: dict = {"cells": [c.id for c in cells], "in_process": [], "ray": {d: [] for d in drafters}, "identical": {}}
    reference = {}
    start_ray(cfg.ray, log_to_driver=False)
    try:
        pools = {}
        for d in drafters:
            pool_cfg = heads_cfg.model_copy(
                update={
                    "ray": heads_cfg.ray.model_copy(
                        # every pool stays up for the whole comparison: reserve fractions of a CPU so they all fit;
                        # the thread count, not the reservation, decides what a process uses
                        update={"num_drafters": d, "torch_threads": threads, "target_num_cpus": 0.25, "drafter_num_cpus": 0.25}
                    )
                }
            )
            pools[d] = EvalPool(pool_cfg, pack_heads(heads_cfg, [kind]))
            pools[d].ready(timeout=900)  # actor start-up (model loading) is not part of the throughput
        for repeat in range(repeats):
            start = time.perf_counter()
            tokens = 0
            for cell in cells:
                questions = pd.DataFrame(run_cell(heads_cfg, cell, target, heads)[1])
                tokens += int(questions["n_tokens"].sum())
                reference[cell.id] = [list(map(int, t)) for t in questions.sort_values(["question_id", "turn"]).tokens]
            seconds = time.perf_counter() - start
            results["in_process"].append({"tokens": tokens, "seconds": seconds})
            print(f"in-process run {repeat}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s", flush=True)
            for d, pool in pools.items():
                with tempfile.TemporaryDirectory() as scratch:
                    store = ResultsStore(scratch)
                    before = pool.worker_stats()[0]
                    start = time.perf_counter()
                    report = pool.run(cells, store, log_line=lambda _: None)
                    seconds = time.perf_counter() - start
                    after = report.worker_stats[0]
                    tokens, same = 0, True
                    for cell in cells:
                        questions = pd.read_parquet(store.cell_dir(cell) / "questions.parquet")
                        tokens += int(questions["n_tokens"].sum())
                        got = [list(map(int, t)) for t in questions.sort_values(["question_id", "turn"]).tokens]
                        same &= got == reference[cell.id]
                forwards = after["forwards"] - before["forwards"]
                sequences = after["sequences_verified"] - before["sequences_verified"]
                results["ray"][d].append(
                    {
                        "tokens": tokens,
                        "seconds": seconds,
                        "failed": report.failed,
                        "verify_s": after["verify_s"] - before["verify_s"],
                        "forwards": forwards,
                        "sequences_per_forward": sequences / forwards if forwards else 0.0,
                    }
                )
                results["identical"].setdefault(d, []).append(same)
                print(f"ray ({d} drafter(s)) run {repeat}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s; "
                      f"identical to in-process: {same}", flush=True)
        for pool in pools.values():
            pool.shutdown()
    finally:
        ray.shutdown()
    return results


def _best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["tokens"] / r["seconds"])


def render(args, cfg, heads_note, verify_rows, evaluation_results, load_before, load_after, wall) -> str:
    command = "python benchmarks/speed/ray_throughput.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Ray throughput",
        "",
        f"Regenerate with `{command}` (about {wall / 60:.0f} min here). {cpu_line()}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"target `{cfg.target.name}` ({cfg.eval.dtype or cfg.target.dtype}), tree {cfg.tree.total_token} tokens "
        f"(depth {cfg.tree.depth}, top-k {cfg.tree.top_k}); {heads_note}. Load average before {load_before}, after "
        f"{load_after}: the CPU is shared with other processes, so absolute numbers move between runs; each "
        "figure is the best of the repeats, and the ratios compare runs made back to back.",
        "",
        "## Batched verification",
        "",
        f"`TargetBatch.step` (one forward over every sequence's tree, acceptance, cache commit) on gsm8k prompts, "
        f"inside the engine's loop (`run_loop`, {args.verify_steps} + 2 new tokens a sequence): up to "
        f"{args.verify_steps} timed steps after one warm-up, those that verify every sequence of the batch "
        f"({', '.join(str(r['timed_steps']) for r in verify_rows)} here), trees drafted by a single head outside "
        "the timing. "
        "Tree tokens/s counts every verified node (root included); it is the verification throughput, independent of "
        "how many drafts are accepted.",
        "",
        "| batch | ms / step | tree tokens/s | × batch 1 | sequence-steps/s |",
        "|---|---|---|---|---|",
    ]
    base = verify_rows[0]["tree_tokens_per_s"]
    for row in verify_rows:
        lines.append(
            f"| {row['batch']} | {row['step_ms']:.1f} | {row['tree_tokens_per_s']:.0f} | "
            f"{row['tree_tokens_per_s'] / base:.2f}× | {row['sequence_steps_per_s']:.1f} |"
        )
    eight = next((r for r in verify_rows if r["batch"] == 8), verify_rows[-1])
    ratio = eight["tree_tokens_per_s"] / base
    lines += ["", f"Goal batch {eight['batch']} ≥ 2× batch 1: **{ratio:.2f}×** — {'met' if ratio >= 2 else 'NOT met'}.", ""]

    if evaluation_results:
        e = evaluation_results
        inproc = _best(e["in_process"])
        lines += [
            "## Evaluation: Ray actors vs in-process",
            "",
            f"The same {len(e['cells'])} cells ({', '.join(f'`{c}`' for c in e['cells'])}; "
            f"{', '.join(f'{b} {n}' for b, n in cfg.eval.benchmarks.items())} questions, "
            f"max_new_tokens {cfg.eval.max_new_tokens}, batch {cfg.eval.batch_size}) decoded in-process "
            "(`run_cell` with an in-process `TargetBatch`) and through Ray (one `TargetWorker`, D `DrafterActor`s, "
            "cells dispatched by `EvalPool`, results written to a results store). Actor start-up excluded. "
            f"Runs alternate in-process / Ray, {args.repeats} times.",
            "",
            "| path | tokens | seconds | tokens/s | vs in-process | sequences per forward | identical tokens |",
            "|---|---|---|---|---|---|---|",
            f"| in-process | {inproc['tokens']} | {inproc['seconds']:.1f} | {inproc['tokens'] / inproc['seconds']:.1f} | 1.00 | "
            f"{cfg.eval.batch_size} (one session) | — |",
        ]
        verdicts = []
        for d, runs in e["ray"].items():
            best = _best(runs)
            share = (best["tokens"] / best["seconds"]) / (inproc["tokens"] / inproc["seconds"])
            same = all(e["identical"][d])
            lines.append(
                f"| Ray, {d} drafter(s) | {best['tokens']} | {best['seconds']:.1f} | {best['tokens'] / best['seconds']:.1f} | "
                f"{share:.2f} | {best['sequences_per_forward']:.2f} | {'yes' if same else 'NO'} |"
            )
            verdicts.append((d, share))
        one = dict(verdicts).get(1, verdicts[0][1])
        lines += [
            "",
            f"Goal Ray ≥ 80% of in-process: **{one:.0%}** (1 drafter) — {'met' if one >= 0.8 else 'NOT met'}.",
            "",
            "All runs (tokens/s): in-process "
            + ", ".join(f"{r['tokens'] / r['seconds']:.1f}" for r in e["in_process"])
            + "; "
            + "; ".join(f"Ray {d} drafter(s) " + ", ".join(f"{r['tokens'] / r['seconds']:.1f}" for r in runs) for d, runs in e["ray"].items())
            + ".",
            "",
            "With one drafter the drafter and the target worker take turns (draft, then verify), like the in-process loop; "
            "the Ray path adds one round trip per verification step (trees out, accepted tokens and features back). "
            "With two drafters on one worker, one drafter drafts while the other's trees are verified; their sessions "
            "(same sampling parameters) share one KV cache, and their trees go into one forward only when they arrive "
            f"within `max_wait_ms` ({cfg.ray.max_wait_ms:g} ms here) of each other — the sequences-per-forward column "
            "says how often that happened (a forward computes only the sessions that submitted, so waiting is never "
            "paid in padded rows). Identical tokens: bf16 results can depend on the batch a sequence is verified in, so "
            "gathered forwards may change a near-tie; with one drafter the batches are exactly the in-process ones.",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--out", default="reports/ray_throughput.md")
    parser.add_argument("--kind", default="eagle2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--verify-steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--questions", type=int, default=4, help="questions per benchmark in the evaluation comparison")
    parser.add_argument("--benchmarks", nargs="+", default=["gsm8k", "mt_bench"])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--proposers", nargs="+", default=None, help="default: the first head and confidence-routed")
    parser.add_argument("--drafters", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-eval", action="store_true")
    args = parser.parse_args()

    from taps_ray.models.target import load_target

    started = time.perf_counter()
    load_before = _load()
    cfg = load_config(args.config)
    cfg = cfg.model_copy(
        update={
            "eval": cfg.eval.model_copy(
                update={
                    "benchmarks": {b: args.questions for b in args.benchmarks},
                    "temperatures": args.temperatures,
                    "max_new_tokens": args.max_new_tokens,
                }
            )
        }
    )
    torch.set_num_threads(cfg.ray.torch_threads or os.cpu_count() or 1)
    target = load_target(cfg.target, dtype=cfg.eval.dtype)
    with tempfile.TemporaryDirectory() as scratch:
        heads_cfg, heads_note = _heads_config(cfg, args.kind, target, Path(scratch))
        verify_rows = verification(cfg, target, heads_cfg, args.kind, args.batches, args.verify_steps, args.repeats)
        evaluation_results = None
        if not args.skip_eval:
            proposers = args.proposers or [cfg.train.mixtures[0], "confidence-routed"]
            evaluation_results = evaluation(cfg, target, heads_cfg, args.kind, proposers, args.repeats, args.drafters)
    text = render(args, cfg, heads_note, verify_rows, evaluation_results, load_before, _load(), time.perf_counter() - started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
