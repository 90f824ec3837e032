#!/usr/bin/env python
"""The fast forward's decode step by thread setting and by oneDNN weight packing, in one run. Not a test.

    python benchmarks/speed/decode_threads.py --config configs/cpu.yaml --dtypes float32 bfloat16 \\
        --out reports/decode_threads.md

Why: a Serve replica's step is a few hundred small kernels, and how OpenMP's threads wait between them decides
much of its time. Each setting runs in its own process, because libgomp reads its environment once, at load:
* `1 thread`;
* `2 threads, passive` (OMP_WAIT_POLICY=PASSIVE: idle threads sleep at once; what the project's Ray processes
  get, because a drafter and its target worker take turns on the same cores);
* `2 threads, spin then sleep` (GOMP_SPINCOUNT=300000 on top of PASSIVE: libgomp's own default, about 3 ms of
  spinning before sleeping; what `serve.replica_omp_wait: default` gives a replica);
* `2 threads, active` (OMP_WAIT_POLICY=ACTIVE: idle threads spin for minutes; `serve.replica_omp_wait: active`).
With `--neighbour-duty D` (a percentage), each setting also runs beside a neighbour: a process on the same
cores that computes for 1 ms and sleeps for the rest of every period so that it is busy D% of one core, as a
benchmark client, Serve's proxy and Ray's own processes are beside a replica (under vLLM's client at 16 in
flight they took about 24% and 12% of a core, per-process CPU time over one ad-hoc run: docs/serve.md#threads). A
team of OpenMP threads splits each kernel statically, so a thread the neighbour displaces holds the others at the
kernel's end.
Within each process the two packings of every projection's weight (`Projection.packed`, oneDNN's reordered
copy laid out for 1 or for 32 rows) are timed in alternating rounds: read their ratio there. The step: plain
decoding of `--steps` tokens over a batch (1, or the first 16 of the serving benchmarks' mixed prompts, ragged),
after its prefill; the median of the rounds' ms per step; the tokens must agree across packings.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "1 thread": (1, {}),
    "2 threads, passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, spin then sleep": (2, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"}),
    "2 threads, active": (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
}
PACKINGS = (1, 32)


def measure(config_path: str, dtype: str, threads: int, batch: int, steps: int, rounds: int) -> dict:
    """In this process: ms per decode step and prefill seconds per packing, and whether the tokens agree."""
    import torch

    from taps_ray.bench.closed_loop import mixed_prompts
    from taps_ray.config import load_config
    from taps_ray.decoding.target_batch import TargetBatch
    from taps_ray.decoding.verify import SamplingParams
    from taps_ray.drafting.tree import build_tree
    from taps_ray.models.cpu_linear import Projection
    from taps_ray.models.target import load_target

    torch.set_num_threads(threads)
    config = load_config(config_path)
    target = load_target(config.target, dtype)
    prompts = mixed_prompts(config, target.tokenizer, 16)[:batch]
    projections = [o for o in gc.get_objects() if isinstance(o, Projection)]
    packed = {rows: [torch.ops.mkldnn._reorder_linear_weight(p.row_weight().contiguous(), rows)
                     for p in projections] for rows in PACKINGS}
    step_ms: dict[int, list[float]] = {rows: [] for rows in PACKINGS}
    prefill_s: dict[int, list[float]] = {rows: [] for rows in PACKINGS}
    tokens: dict[int, list[list[int]]] = {}
    for round_ in range(rounds + 1):  # the first round warms up
        for rows in PACKINGS:
            for projection, weight in zip(projections, packed[rows]):
                projection.packed = weight
            started = time.perf_counter()
            batch_ = TargetBatch(target.model)
            last = [c.tokens[-1] for c in batch_.start(prompts, SamplingParams(), list(range(len(prompts))))]
            prefilled = time.perf_counter()
            out = []
            for _ in range(steps):
                trees = [build_tree(torch.tensor([token]), torch.tensor([-1])) for token in last]
                last = [c.tokens[-1] for c in batch_.step(trees)]
                out.append(last)
            if round_:
                step_ms[rows].append((time.perf_counter() - prefilled) / steps * 1000)
                prefill_s[rows].append(prefilled - started)
            tokens[rows] = out
    return {"step_ms": {rows: statistics.median(v) for rows, v in step_ms.items()},
            "prefill_s": {rows: statistics.median(v) for rows, v in prefill_s.items()},
            "same": all(tokens[rows] == tokens[PACKINGS[0]] for rows in PACKINGS),
            "prompt_tokens": sum(len(p) for p in prompts)}


def neighbour(duty: int) -> None:
    """Busy `duty`% of one core until killed: 1 ms of computing, then a sleep."""
    period = 1e-3 * 100 / duty
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < 1e-3:
            pass
        time.sleep(period - 1e-3)


def run_setting(args: argparse.Namespace, setting: str, dtype: str, batch: int, duty: int) -> dict:
    threads, env = SETTINGS[setting]
    child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    child_env.update(env, OMP_NUM_THREADS=str(threads))
    command = [sys.executable, __file__, "--child", json.dumps({
        "config": args.config, "dtype": dtype, "threads": threads, "batch": batch, "steps": args.steps,
        "rounds": args.rounds})]
    beside = subprocess.Popen([sys.executable, __file__, "--neighbour", str(duty)]) if duty else None
    try:
        done = subprocess.run(command, env=child_env, capture_output=True, text=True, check=True)
    finally:
        if beside is not None:
            beside.kill()
            beside.wait()
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbour-duty", nargs="+", type=int, default=[0],
                        help="percent of one core a neighbouring process keeps busy (0: none); one run each")
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--neighbour", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.neighbour:
        neighbour(args.neighbour)
    if args.child:
        request = json.loads(args.child)
        print(json.dumps(measure(request["config"], request["dtype"], request["threads"], request["batch"],
                                 request["steps"], request["rounds"])))
        return 0

    from taps_ray.fsio import report_lines
    from taps_ray.machine import cpu_line
    from taps_ray.markdown import md_table

    rows = []
    for dtype, batch, duty, setting in itertools.product(args.dtypes, args.batches, args.neighbour_duty, SETTINGS):
        result = run_setting(args, setting, dtype, batch, duty)
        ms, prefill = result["step_ms"], result["prefill_s"]
        rows.append([dtype, str(batch), f"{duty}%", setting, *(f"{ms[str(r)]:.1f}" for r in PACKINGS),
                     f"{ms[str(PACKINGS[0])] / ms[str(PACKINGS[1])]:.2f}x",
                     *(f"{prefill[str(r)]:.2f}" for r in PACKINGS), "yes" if result["same"] else "NO"])
        print(" | ".join(rows[-1]), flush=True)
    command = "python benchmarks/speed/decode_threads.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = ["dtype", "batch", "neighbour", "threads", "step ms, packed for 1 row", "step ms, packed for 32",
              "32 vs 1", "prefill s (1)", "prefill s (32)", "same tokens"]
    lines = ["# The decode step by OpenMP wait policy and oneDNN weight packing", "",
             f"Regenerate: `{command}`. {cpu_line()}; load average at the end {os.getloadavg()[0]:.1f}. "
             f"SmolLM2-135M-Instruct (`{args.config}`'s target), plain decoding of {args.steps} tokens after the "
             "prefill, batch 1 (one prompt) or 16 (ragged mixed GSM8K / MT-Bench prompts); each thread setting in "
             f"its own process, the two packings alternating within it, median of {args.rounds} rounds. What each "
             "setting is: the script's docstring. Compare packings within a row and settings within a dtype and "
             "batch. `neighbour`: the share of one core a neighbouring process kept busy.", "", md_table(header, rows)]
    report_lines(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
