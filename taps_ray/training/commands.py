"""Command functions for features, training and the heads report (wired into ``taps`` by taps_ray/cli.py).

Also runnable directly:

    python -m taps_ray.training.commands features --config configs/cpu.yaml [--mixture math]
    python -m taps_ray.training.commands train --config configs/cpu.yaml --kind hass --mixture math
    python -m taps_ray.training.commands report --config configs/cpu.yaml      # writes <reports_dir>/heads.md

``report`` trains whatever head of train.kinds × train.mixtures is missing (finished ones are reused, killed
ones resume), measures every head's held-out agreement with the target on math and chat, and writes the
report with the feature-extraction and training throughput.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from taps_ray.config import HEAD_KINDS, StudyConfig, load_config, with_overrides
from taps_ray.fsio import atomic_write_json, atomic_write_text
from taps_ray.models.target import Target, load_target
from taps_ray.training.agreement import DEFAULT_DOMAINS, cached_agreement
from taps_ray.training.features import extract_features
from taps_ray.training.trainer import METRICS_FILE, configure_threads, train_head

log = logging.getLogger(__name__)


def cmd_features(cfg: StudyConfig, mixture_name: str | None = None, target: Target | None = None) -> dict:
    """Extract (or reuse) the features of one mixture, or of every mixture in train.mixtures; returns stats."""
    configure_threads()
    names = [mixture_name] if mixture_name else list(dict.fromkeys(cfg.train.mixtures))
    target = target or load_target(cfg.target)
    out = {}
    for name in names:
        features = extract_features(cfg, name, target=target)
        out[name] = {"folder": str(features.folder), **features.stats}
        print(f"features {name}: {json.dumps(out[name])}")
    return out


def cmd_train(cfg: StudyConfig, kind: str, mixture_name: str, target: Target | None = None) -> Path:
    """Train (or resume) one head; prints per-epoch metrics and returns the final checkpoint folder."""
    path = train_head(cfg, kind, mixture_name, report=lambda m: print(json.dumps(m)), target=target)
    print(f"head {kind}-{mixture_name}: {path}")
    return path


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def cmd_agreement_report(cfg: StudyConfig, domains: Sequence[str] = DEFAULT_DOMAINS, output: str | Path | None = None) -> Path:
    """Train the missing heads of train.kinds × train.mixtures, evaluate each on the held-out `domains`, and
    write ``<reports_dir>/heads.md`` plus ``heads.json`` (the raw numbers)."""
    threads = configure_threads()
    started = time.time()
    load_before = _load_average()
    target = load_target(cfg.target)
    features = {}
    for name in dict.fromkeys([*cfg.train.mixtures, *domains]):
        fs = extract_features(cfg, name, target=target)
        features[name] = {k: v for k, v in fs.stats.items()}
    heads = []
    for mixture in cfg.train.mixtures:
        for kind in cfg.train.kinds:
            call_start = time.perf_counter()
            path = train_head(cfg, kind, mixture, target=target)
            call_s = time.perf_counter() - call_start
            state = json.loads((path / METRICS_FILE).read_text())
            agreement = cached_agreement(cfg, path, domains, target=target)
            heads.append({"kind": kind, "mixture": mixture, "path": str(path), "call_seconds": round(call_s, 1),
                          "state": {k: v for k, v in state.items() if k != "feature_stats"}, "agreement": agreement})
            print(f"{kind}-{mixture}: " + ", ".join(f"{d} {agreement[d]['acc']:.3f}" for d in domains))
    summary = {
        "config": cfg.name,
        "target": cfg.target.name,
        "dtype": cfg.target.dtype,
        "threads": threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "wall_seconds": round(time.time() - started, 1),
        "features": features,
        "heads": heads,
        "mixtures": {k: v.model_dump() for k, v in cfg.mixtures.items()},
        "features_config": cfg.features.model_dump(),
        "train_config": cfg.train.model_dump(),
    }
    folder = Path(output) if output else Path(cfg.reports_dir)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "heads.json", summary)
    return write_report(summary, folder, domains)


def write_report(summary: dict, folder: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS) -> Path:
    path = Path(folder) / "heads.md"
    atomic_write_text(path, render_report(summary, domains))
    print(f"wrote {path}")
    return path


def render_report(s: dict, domains: Sequence[str]) -> str:
    t, f = s["train_config"], s["features_config"]
    lines = [
        f"# Draft heads — `{s['config']}` config",
        "",
        f"Target `{s['target']}` ({s['dtype']}), heads trained in fp32 on the CPU ({s['machine']}; threads per "
        "head in the training table: 1 means a Ray Tune trial or OMP_NUM_THREADS=1). Regenerate with "
        f"`python -m taps_ray.training.commands report --config configs/{s['config']}.yaml`.",
        "",
        "Budget: " + ", ".join(f"`{name}` {m['size']} conversations ({' + '.join(f'{c} {r:g}' for c, r in m['mixture'].items())})"
                               for name, m in s["mixtures"].items() if name in {h['mixture'] for h in s['heads']}) + "; "
        f"max_len {f['max_len']}, top-K {f['top_k']}, epochs {t['epochs']}, max_tokens {t['max_tokens']}, "
        f"batch {t['batch_size']}, lr {t['lr']:g} (warm-up {t['warmup_ratio']:g}, cosine), grad clip {t['grad_clip_value']:g} "
        f"by value, noise std {t['noise_std']:g}, HASS {t['hca_passes']} HCA passes and top-K weight {t['topk_weight']:g}, "
        f"held-out fraction {t['heldout_fraction']:g}, loss mask `{t['mask_alignment']}`.",
        "",
        "## Held-out next-token agreement with the target",
        "",
        "Top-1 of the head's draft equals the target's top-1, on the assistant tokens of the held-out "
        "conversations of each domain (the same conversations for every head; none of them was trained on). "
        "`depth 1` is the first draft step (true target features); `depth 3` feeds the head its own two previous "
        "predictions (HASS harmonized context), the situation deeper in a draft tree.",
        "",
    ]
    header = "| head | trained on | " + " | ".join(f"{d} depth 1" for d in domains) + " | " + \
             " | ".join(f"{d} depth 3" for d in domains) + " |"
    lines += [header, "|" + "---|" * (2 + 2 * len(domains))]
    for h in s["heads"]:
        a = h["agreement"]
        best = [max((x["agreement"][d]["acc"] for x in s["heads"] if x["kind"] == h["kind"]), default=None) for d in domains]
        cells = []
        for d, b in zip(domains, best):
            v = a[d]["acc"]
            cells.append(f"**{v:.3f}**" if b is not None and abs(v - b) < 1e-12 else f"{v:.3f}")
        deep = [_fmt(a[d].get("acc_2")) for d in domains]
        lines.append(f"| {h['kind']}-{h['mixture']} | {h['mixture']} | " + " | ".join(cells) + " | " + " | ".join(deep) + " |")
    lines += ["", "Scored tokens per domain: " + ", ".join(
        f"{d} {s['heads'][0]['agreement'][d]['tokens']} ({s['heads'][0]['agreement'][d]['conversations']} conversations)"
        for d in domains) + ". Bold: the best head of its kind on that domain.", ""]
    own = []
    for h in s["heads"]:
        if h["mixture"] in domains:
            other = [d for d in domains if d != h["mixture"]]
            better = all(h["agreement"][h["mixture"]]["acc"] > x["agreement"][h["mixture"]]["acc"]
                         for x in s["heads"] if x["kind"] == h["kind"] and x["mixture"] in other)
            own.append(f"{h['kind']}-{h['mixture']} {'beats' if better else 'does NOT beat'} the other-domain "
                       f"{h['kind']} head on {h['mixture']}")
    if own:
        lines += ["Specialisation: " + "; ".join(own) + ".", ""]

    lines += ["## Feature extraction", "",
              "| mixture | conversations | tokens | run through the target | copied from another mixture | seconds | "
              "tokens/s | tokens per CPU-second |", "|---|---|---|---|---|---|---|---|"]
    for name, st in s["features"].items():
        computed = st.get("computed_tokens", st["tokens"])
        timing = (f"{_fmt(st.get('extract_s'), 1)} | {_fmt(st.get('tokens_per_s'), 0)} | "
                  f"{_fmt(st.get('tokens_per_cpu_s'), 0)}") if computed else "– | – | –"
        lines.append(f"| {name} | {st['conversations']} | {st['tokens']} | {computed} | "
                     f"{st.get('copied_conversations', 0)} conversations | {timing} |")
    lines += ["", "Tokens are all conversation tokens (prompt and answer) the target ran over, in right-padded "
              f"length-sorted batches of {f['batch_size']}; the time covers the target forward, the LM head and the "
              "top-K. Tokens per CPU-second divide by the process's CPU time (all threads), a figure that other "
              "load on the machine disturbs much less than the wall-clock one.", ""]

    lines += ["## Training", "",
              "| head | epochs | steps | trained tokens | threads | train seconds | tokens/s | tokens per CPU-second | "
              "held-out loss (own) | held-out agreement (own) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[str, list[float]] = {}
    for h in s["heads"]:
        st = h["state"]
        last = st["history"][-1] if st["history"] else {}
        secs, cpu = st["train_seconds"], st.get("train_cpu_seconds")
        group = "math + chat" if h["mixture"] in domains else h["mixture"]
        wall_cpu = groups.setdefault(group, [0.0, 0.0])
        wall_cpu[0] += secs
        wall_cpu[1] += cpu or 0.0
        epochs = st["tokens"] / max(1, st.get("epoch_size_tokens") or st["tokens"])
        lines.append(f"| {h['kind']}-{h['mixture']} | {epochs:.2f} | {st['step']} | {st['tokens']} | {st.get('threads', '–')} | {secs:.0f} | "
                     f"{st['tokens'] / max(secs, 1e-9):.0f} | {_fmt(st['tokens'] / cpu if cpu else None, 0)} | "
                     f"{_fmt(last.get('heldout_loss'))} | {_fmt(last.get('heldout_acc'))} |")
    lines += ["", "Training time (optimizer steps only, held-out evaluation excluded): " + ", ".join(
        f"{g} heads {wall / 60:.1f} min wall, {cpu / 60:.1f} CPU-min" for g, (wall, cpu) in groups.items()) +
        ". Wall-clock figures depend on what else runs on the machine (load average per epoch below, where "
        "recorded); CPU time much less, and on an idle 2-core machine two threads finish in about half the "
        "CPU time (an estimate, not a measurement). Tokens/s counts every token of a "
        "conversation (prompt and answer) per optimizer step; a HASS step runs its HCA passes over the batch. "
        "Held-out loss is the EAGLE loss (regression + 0.1 soft CE) for both kinds.", ""]
    per_epoch = ["| head | " + " | ".join(["epoch", "train loss", "held-out loss", "held-out agreement", "tokens/s",
                                           "tokens per CPU-second", "load average"]) + " |",
                 "|---|---|---|---|---|---|---|---|"]
    for h in s["heads"]:
        for m in h["state"]["history"]:
            per_epoch.append(f"| {h['kind']}-{h['mixture']} | {m['epoch']} | {_fmt(m['train_loss'])} | "
                             f"{_fmt(m['heldout_loss'])} | {_fmt(m['heldout_acc'])} | {_fmt(m['tokens_per_s'], 0)} | "
                             f"{_fmt(m.get('tokens_per_cpu_s'), 0)} | {_fmt(m.get('load_average'), 1)} |")
    per_epoch += ["", "Train loss is the kind's own objective on the pass-0 batch (HASS: with its top-K term), so it is "
                  "not comparable across kinds; held-out loss is the EAGLE loss for both."]
    lines += ["### Per epoch", "", *per_epoch, "",
              "## Run", "",
              f"Whole report run {s['wall_seconds'] / 60:.1f} min (features, training of missing heads, evaluation); "
              f"load average before {s['load_average_before']}, after {s['load_average_after']} "
              "(other processes on the machine slow every figure here).", "",
              "## How these heads are trained", "",
              "* Features: `hidden_states[-1]` of the target (after its final norm) and its top-K next-token "
              "probabilities, from right-padded batches with the attention mask built from the lengths; "
              "assistant content plus its closing end-of-turn token carry the loss mask (ALGORITHMS.md §7, CLEAN).",
              "* Position t gets (h_t + uniform noise · std · 512 / L, x_{t+1}) and regresses h_{t+1}; it is trained "
              "when the token it predicts, x_{t+2}, is an assistant token (`mask_alignment: predicted`; the "
              "reference's unshifted mask is `ref`). Losses are normalised by the mask sum.",
              "* EAGLE-2: SmoothL1 regression + 0.1 · soft cross-entropy against softmax(lm_head(h_{t+1})). HASS adds "
              "the top-K distillation term (stored target probabilities, not renormalised) and harmonized context "
              "alignment over the HCA passes, with a proper −inf mask (the CLEAN variant of §2.3), gradients "
              "accumulated across passes.",
              "* Held-out: a conversation is held out when a hash of (seed, id) falls under the held-out fraction, "
              "the same rule in every mixture, so no head trained on any conversation scored above.",
              "* Answers are the corpora's own (human / GSM8K-train) answers; `features.regenerate_answers: true` "
              "trains on the target's greedy answers instead (higher agreement in the prototype, but it costs a "
              "batched generation pass).", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taps_ray.training.commands", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("features", "train", "report"):
        p = sub.add_parser(name)
        p.add_argument("--config", required=True)
        p.add_argument("--data-dir", default=None, help="local data directory (overrides TAPS_DATA_DIR and the config's data_dir)")
        if name in ("features", "train"):
            p.add_argument("--mixture", default=None, required=name == "train")
        if name == "train":
            p.add_argument("--kind", choices=HEAD_KINDS, required=True)
        if name == "report":
            p.add_argument("--output", default=None, help="folder for heads.md (default: the config's reports_dir)")
            p.add_argument("--render-only", action="store_true",
                           help="only re-render heads.md from the heads.json of an earlier run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = with_overrides(load_config(args.config), data_dir=args.data_dir)
    if args.command == "features":
        cmd_features(cfg, args.mixture)
    elif args.command == "train":
        cmd_train(cfg, args.kind, args.mixture)
    elif args.render_only:
        folder = Path(args.output) if args.output else Path(cfg.reports_dir)
        write_report(json.loads((folder / "heads.json").read_text()), folder)
    else:
        cmd_agreement_report(cfg, output=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
