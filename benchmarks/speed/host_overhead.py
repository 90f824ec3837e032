#!/usr/bin/env python
"""Host syncs and host milliseconds per decoding step at batch 1, 4 and 16, on the tiny target. Not a test.

    python benchmarks/speed/host_overhead.py --vocabs 49152 512 --temperatures 0 0.8 \
        --json reports/results/host_overhead.json --before reports/results/host_overhead_before.json --out reports/host_overhead.md

The tiny target (configs/tiny.yaml: random weights, 2 layers of width 64) decodes random prompts greedily through
the in-process loop (`decoding.generate.run_loop` over a `TargetBatch`) with a random EAGLE-2 head drafting real
trees, no stop token, so every sequence runs its whole budget. Its layers are small, but over the tokenizer's
49k-token vocabulary its LM heads, softmaxes and top-k are not, and on a CPU they count as host time; with a small
vocabulary (`--vocabs 512`) a step's time is host work: the Python that drafts, builds masks, accepts and commits,
which on a GPU runs while the device idles.

* syncs/step: calls that would block the host on a GPU (`taps_ray.syncs.SyncCounter`: item, tolist, int/bool/float
  of a tensor, nonzero, boolean indexing, device-to-host copies), counted over the decode (prefill excluded), per
  verification step. Counting is exact and machine independent; so is torch calls/step (every call counted).
* host ms/step: wall milliseconds per step of the same decode without counting (median of `--repeats` runs);
  `forward ms` is the share inside the target's forward (`TargetBatch.timings`), the part a device would run.

`--before` adds the numbers of an earlier run (the JSON another checkout wrote with `--json`) as a baseline.

* aten ops/step on the Llama-3-8B shape (benchmarks/speed/step_ops.py: no weights, no GPU): the ops a target step
  dispatches from Python, for plain decoding and the paper tree (60/5/10) at batch 1 and 16, eager and with the
  step captured (`target.compile: step`), split into the ops outside and inside the captured region; launched
  counts a captured graph as one. The last line ends with `ops/step plain=A spec_b1=B spec_b16=C` (captured).
  `--ops-only` runs this part alone (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from taps_ray.config import TreeConfig, load_config  # noqa: E402
from taps_ray.decoding.generate import run_loop  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.drafting.proposers import SingleHead  # noqa: E402
from taps_ray.drafting.eagle2 import DraftContext  # noqa: E402
from taps_ray.fsio import atomic_write_json, report_lines  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.draft_head import new_head  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402
from taps_ray.syncs import SyncCounter  # noqa: E402
from step_ops import merge_ops, step_ops  # noqa: E402


class CountedTarget:
    """A `TargetBatch` that counts its verification steps and the syncs of its prefill (kept out of per step)."""

    def __init__(self, batch: TargetBatch, counter: SyncCounter | None) -> None:
        self.batch, self.counter = batch, counter
        self.steps, self.start_syncs, self.start_calls, self.start_s = 0, 0, 0, 0.0

    def start(self, prompts, params, seeds):
        before, calls = (self.counter.syncs, self.counter.calls) if self.counter else (0, 0)
        t0 = time.perf_counter()
        out = self.batch.start(prompts, params, seeds)
        self.start_s = time.perf_counter() - t0
        if self.counter:
            self.start_syncs, self.start_calls = self.counter.syncs - before, self.counter.calls - calls
        return out

    def step(self, trees):
        self.steps += 1
        return self.batch.step(trees)


def decode(target, proposer, prompts, params: SamplingParams, max_new: int, count: bool) -> dict:
    """One decode of `prompts`; syncs per step (when `count`) or milliseconds per step."""
    counter = SyncCounter() if count else None
    verifier = CountedTarget(TargetBatch(target.model), counter)
    seeds = list(range(len(prompts)))  # fixed: every run of the benchmark samples the same tokens
    t0 = time.perf_counter()
    if counter is not None:
        with counter:
            generations = run_loop(verifier, proposer, prompts, params, max_new, stop_ids=[], seeds=seeds)
    else:
        generations = run_loop(verifier, proposer, prompts, params, max_new, stop_ids=[], seeds=seeds)
    wall = time.perf_counter() - t0 - verifier.start_s
    steps = verifier.steps
    accepted = sum(s.accepted for g in generations for s in g.steps)
    out = {"steps": steps, "accepted_per_step": accepted / sum(len(g.steps) for g in generations)}
    if counter is not None:
        out["syncs_per_step"] = (counter.syncs - verifier.start_syncs) / steps
        out["calls_per_step"] = (counter.calls - verifier.start_calls) / steps
        out["by_name"] = dict(counter.by_name.most_common())
    else:
        out["host_ms"] = 1e3 * wall / steps
        out["forward_ms"] = 1e3 * verifier.batch.timings["forward"] / steps
    return out


def measure(config, tree: TreeConfig, vocab_size: int | None, temperature: float, args: argparse.Namespace
            ) -> dict[str, dict]:
    """Syncs and milliseconds per step at each batch size, for the tiny target with `vocab_size` tokens (None:
    the config's, the tokenizer's 49k), greedy (temperature 0) or sampled."""
    target_config = config.target.model_copy(update={"device": "cpu"})
    if vocab_size is not None:
        target_config = target_config.model_copy(update={"tiny": target_config.tiny.model_copy(
            update={"vocab_size": vocab_size})})
    target = load_target(target_config)
    head = new_head(target.model.config, seed=0)
    proposer = SingleHead("eagle2", head, DraftContext(target.model.get_input_embeddings(), target.model.lm_head),
                          tree)
    vocab = target.model.config.vocab_size
    params = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    results = {}
    for batch in args.batches:
        prompts = torch.randint(10, vocab, (batch, args.prompt_len), generator=generator).tolist()
        counted = decode(target, proposer, prompts, params, args.max_new, count=True)
        decode(target, proposer, prompts, params, args.max_new, count=False)  # warm-up
        timed = [decode(target, proposer, prompts, params, args.max_new, count=False) for _ in range(args.repeats)]
        results[str(batch)] = {**counted, "host_ms": statistics.median(t["host_ms"] for t in timed),
                               "forward_ms": statistics.median(t["forward_ms"] for t in timed)}
    return {"vocab": vocab, "temperature": temperature, "batches": results}


def _runs(record: dict) -> list[tuple[str, float, dict]]:
    """(vocabulary, temperature, results by batch) of a record; records written before `--vocabs` ran the
    tokenizer's, before `--temperatures` greedy only."""
    results = record["results"]
    if all("batches" in r for r in results.values()):
        return [(str(r["vocab"]), r.get("temperature", 0.0), r["batches"]) for r in results.values()]
    return [("49152", 0.0, results)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocabs", type=int, nargs="+", default=None,
                        help="tiny-target vocabulary sizes to run (default: the config's, the tokenizer's 49k)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                        help="sampling temperatures to run (0: greedy; the summary line is greedy's)")
    parser.add_argument("--json", default=None, help="also write the numbers here (a later run's --before)")
    parser.add_argument("--before", default=None, help="an earlier run's --json, shown as the baseline")
    parser.add_argument("--out", default=None, help="write the markdown here (else print it)")
    parser.add_argument("--ops-only", action="store_true", help="only the aten ops per step on the 8B shape")
    args = parser.parse_args()

    ops = step_ops()
    ops_lines = _ops_lines(ops)
    if args.ops_only:
        command = "python benchmarks/speed/host_overhead.py --ops-only" + (f" --out {args.out}" if args.out else "")
        report_lines(["# Aten ops per target step, Llama-3-8B shape", "",
                      f"Regenerate with `{command}`. {cpu_line()}; torch {torch.__version__} (the counts do not "
                      "depend on the machine).", "", *ops_lines], args.out)
        return 0

    torch.manual_seed(0)
    config = load_config(ROOT / args.config)
    tree = TreeConfig(**config.tree.model_dump())
    results = {}
    for temperature in args.temperatures:
        for vocab_size in args.vocabs or [None]:
            run = measure(config, tree, vocab_size, temperature, args)
            results[f"{run['vocab']}@{temperature:g}"] = run
    git = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
    if os.popen(f"git -C {ROOT} status --porcelain --untracked-files=no").read().strip():
        git += "+changes"  # the working tree differs from the commit
    record = {"commit": git, "cpu": cpu_line(), "tree": tree.model_dump(), "results": results}
    if args.json:
        atomic_write_json(args.json, record)
    before = json.loads(Path(args.before).read_text()) if args.before else None

    command = "python benchmarks/speed/host_overhead.py" + "".join(
        f" --{k} {v}" for k, v in (("vocabs", " ".join(map(str, args.vocabs or []))),
                                   ("temperatures", " ".join(f"{t:g}" for t in args.temperatures)
                                    if args.temperatures != [0.0] else ""),
                                   ("json", args.json),
                                   ("before", args.before), ("out", args.out)) if v)
    lines = [
        "# Host overhead per decoding step (tiny target)",
        "",
        f"Regenerate with `{command}`. {cpu_line()}; torch threads {torch.get_num_threads()}. The tiny target "
        f"(`{args.config}`, random weights) decodes {args.max_new} tokens of random {args.prompt_len}-token "
        f"prompts through `run_loop` with a random EAGLE-2 head drafting trees of total_token {tree.total_token}, "
        f"depth {tree.depth}, top_k {tree.top_k}, greedy (T 0) or sampled (T > 0: one vectorised acceptance pass "
        "with per-position draws, as greedy). syncs/step: calls that would block the host on a GPU "
        "(`taps_ray/syncs.py`), prefill excluded; host ms/step: median wall ms per step of "
        f"{args.repeats} runs (forward ms: the part inside the target's forward).",
        "",
        "The 49k-token vocabulary of the SmolLM2 tokenizer makes the vocabulary-sized kernels (both LM heads, the "
        "softmaxes, top-k, entropies) most of a step on a CPU at batch 16, where a GPU runs them while the host "
        "goes on; a run with a small vocabulary (`--vocabs`) leaves the host's own work: the Python and the "
        "dispatch of every op. torch calls/step counts that dispatch (every call the counting mode sees), "
        "machine independent like the syncs.",
        "",
        "| run | commit | vocab | T | batch | steps | accepted/step | syncs/step | torch calls/step | host ms/step | "
        "forward ms/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, rec in (("before", before), ("after", record)):
        if rec is None:
            continue
        for vocab, temperature, batches in _runs(rec):
            for batch, r in batches.items():
                calls = f"{r['calls_per_step']:.0f}" if "calls_per_step" in r else "–"
                lines.append(f"| {label} | {rec['commit']} | {vocab} | {temperature:g} | {batch} | {r['steps']} | "
                             f"{r['accepted_per_step']:.2f} | {r['syncs_per_step']:.1f} | {calls} | "
                             f"{r['host_ms']:.1f} | {r['forward_ms']:.1f} |")
    if before is not None:
        lines += ["", f"The before run: {before['cpu']}."]
    greedy = 0.0 if 0.0 in args.temperatures else args.temperatures[0]
    vocab, _, batches = [run for run in _runs(record) if run[1] == greedy][-1]  # the summary line's run
    lines += ["", f"Syncs at the largest batch (vocabulary {vocab}), by call: " + ", ".join(
        f"{name} {n}" for name, n in batches[str(max(args.batches))]["by_name"].items()) + "."]
    small, large = batches[str(min(args.batches))], batches[str(max(args.batches))]
    lines += ["", f"The summary line's syncs and host ms are the vocabulary-{vocab}, T {greedy:g} run's."]
    lines += ["", *ops_lines[:-1], "",
              f"syncs/step b{min(args.batches)}={small['syncs_per_step']:.1f} "
              f"b{max(args.batches)}={large['syncs_per_step']:.1f}; host_ms/step "
              f"b{min(args.batches)}={small['host_ms']:.1f} b{max(args.batches)}={large['host_ms']:.1f}; "
              + ops_lines[-1]]
    report_lines(lines, args.out)
    return 0


def _ops_lines(ops: dict[str, dict[str, dict[str, int]]]) -> list[str]:
    """The ops table (eager and captured) and the summary `ops/step plain=A spec_b1=B spec_b16=C` (captured)."""
    lines = ["Aten ops per target step on the Llama-3-8B shape (benchmarks/speed/step_ops.py: the 8B's 32 layers "
             "and 32/8 heads at small widths, bf16, projections as on a GPU; one `TargetBatch.step` from trees to "
             "results, drafting excluded). Captured: the ops of the step's graph are counted inside, launched "
             "counts the graph as one.", "",
             "| step | run | outside | inside captured | launched from Python |", "|---|---|---:|---:|---:|"]
    for mode, runs in ops.items():
        for name, r in runs.items():
            lines.append(f"| {mode} | {name} | {r['outside']} | {r['inside']} | {r['launched']} |")
    lines += ["", "Aten ops of a merged proposer's merge per step (benchmarks/speed/step_ops.py `merge_ops`: two paper "
              "trees per sequence stacked, their means read, merged on the device; drafting excluded); the same "
              "ops whatever the batch but for the merged trees' views (a handful per sequence).", "",
              "| merge | batch 1 | batch 16 |", "|---|---:|---:|"]
    lines += [f"| {mode} | {merge_ops(1, mode)} | {merge_ops(16, mode)} |" for mode in ("concat", "dedup", "budget",
                                                                                       "rank")]
    captured = ops["captured"]
    return [*lines, "", "ops/step " + " ".join(f"{name}={r['launched']}" for name, r in captured.items())]


if __name__ == "__main__":
    raise SystemExit(main())
