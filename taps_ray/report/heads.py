"""The heads report: ``heads.md`` from the numbers of the trained heads (``heads.json``).

Held-out agreement with the target per domain, feature-extraction and training throughput, per-epoch metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from taps_ray.eval.store import atomic_write_text
from taps_ray.training.agreement import DEFAULT_DOMAINS


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_heads_md(summary: dict, folder: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS) -> Path:
    path = Path(folder) / "heads.md"
    atomic_write_text(path, render_heads_md(summary, domains))
    print(f"wrote {path}")
    return path


def render_heads_md(s: dict, domains: Sequence[str]) -> str:
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
