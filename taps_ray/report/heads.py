"""The heads report: ``heads.md`` and ``heads.json`` from what training left in the work dir.

Held-out agreement with the target per domain, dataset answers vs target answers (the `train.compare` heads
beside their target-answer twins, with the sweep's tau where its results exist), feature-extraction and training
throughput, per-epoch metrics. The report only reads: the feature manifests, each head's ``metrics.json``, its
remembered held-out agreement (measured after training, `training.agreement.measure_agreement`) and the results
store's ``summary.parquet``. Whatever is missing is marked in the tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pandas as pd

from taps_ray.config import StudyConfig
from taps_ray.fsio import atomic_write_text
from taps_ray.report.findings import MATH_BENCHES
from taps_ray.training.agreement import DEFAULT_DOMAINS, head_finals, read_agreement
from taps_ray.training.features import MANIFEST, features_folder
from taps_ray.training.trainer import load_final_metrics
from taps_ray.workdir import in_workdir, results_dir

NOT_TRAINED = "not trained"
NOT_MEASURED = "not measured"
NOT_EXTRACTED = "not extracted"
DOMAIN_BENCHMARKS = {"math": MATH_BENCHES, "chat": ("mt_bench",)}  # where a domain's heads are measured by tau


def heads_summary(cfg: StudyConfig, domains: Sequence[str] = DEFAULT_DOMAINS) -> dict:
    """The report's numbers, read from the work dir; a head not trained has state None, one not measured
    agreement None, a feature set not extracted stats None."""
    heads = []
    for kind, mixture, final in head_finals(cfg):
        trained = (final / "model.safetensors").is_file()
        state = {k: v for k, v in load_final_metrics(final).items() if k != "feature_stats"} if trained else {}
        heads.append({"kind": kind, "mixture": mixture, "path": in_workdir(cfg, final),
                      "state": state or None, "agreement": read_agreement(cfg, final, domains) if trained else None,
                      "tau": {d: _tau(cfg, kind, mixture, b) for d, b in DOMAIN_BENCHMARKS.items()}})
    machines = sorted({h["state"]["machine"] for h in heads if h["state"] and h["state"].get("machine")})
    return {
        "config": cfg.name,
        "target": cfg.target.name,
        "dtype": cfg.target.dtype,
        "machine": "; ".join(machines) or None,
        "features": {name: _feature_stats(cfg, name) for name in dict.fromkeys([*cfg.head_mixtures(), *domains])},
        "heads": heads,
        "comparison": _answers_comparison(cfg, heads, domains),
        "mixtures": {k: v.model_dump() for k, v in cfg.mixtures.items()},
        "features_config": cfg.features.model_dump(),
        "train_config": cfg.train.model_dump(),
    }


def answers_twin(cfg: StudyConfig, mixture: str) -> str | None:
    """The mixture of train.mixtures with the same corpora, size and seed as `mixture` but the other answers."""
    own = cfg.mixtures[mixture]
    for name in cfg.train.mixtures:
        other = cfg.mixtures[name]
        if other.answers != own.answers and other.model_dump(exclude={"answers"}) == own.model_dump(exclude={"answers"}):
            return name
    return None


def _answers_comparison(cfg: StudyConfig, heads: list[dict], domains: Sequence[str]) -> list[dict]:
    """Per `train.compare` head with a twin in a domain: both heads' own-domain held-out agreement (depth 1 and 3)
    and their T = 0 tau on the domain's benchmarks, keyed by answers (dataset / target)."""
    by_key = {(h["kind"], h["mixture"]): h for h in heads}
    rows = []
    for mixture, kinds in cfg.train.compare.items():
        twin = answers_twin(cfg, mixture)
        if twin not in domains:
            continue
        for kind in kinds:
            pair = {cfg.mixtures[m].answers: m for m in (mixture, twin)}
            agreement = {a: (by_key.get((kind, m), {}).get("agreement") or {}).get(twin) for a, m in pair.items()}
            rows.append({"kind": kind, "domain": twin, "heads": pair,
                         "acc": {a: x and x["acc"] for a, x in agreement.items()},
                         "acc_2": {a: x and x.get("acc_2") for a, x in agreement.items()},
                         "tau": {a: _tau(cfg, kind, m, DOMAIN_BENCHMARKS.get(twin, ())) for a, m in pair.items()}})
    return rows


def _tau(cfg: StudyConfig, kind: str, proposer: str, benchmarks: Sequence[str]) -> float | None:
    """Σ new tokens / Σ steps of the proposer's T = 0 cells on `benchmarks`, None before the sweep's eval."""
    path = results_dir(cfg) / "summary.parquet"
    if not path.is_file():
        return None
    s = pd.read_parquet(path)
    cells = s[(s["head_kind"] == kind) & (s["proposer"] == proposer) & (s["temperature"] == 0)
              & s["benchmark"].isin(list(benchmarks))]
    return float(cells["new_tokens"].sum() / cells["steps"].sum()) if len(cells) and cells["steps"].sum() else None


def _feature_stats(cfg: StudyConfig, name: str) -> dict | None:
    manifest = features_folder(cfg, name) / MANIFEST
    return json.loads(manifest.read_text())["stats"] if manifest.is_file() else None


def build_heads_report(cfg: StudyConfig, output: str | Path | None = None,
                       domains: Sequence[str] = DEFAULT_DOMAINS) -> Path:
    """Write ``heads.json`` (the raw numbers) and ``heads.md`` into `output` (default: the config's reports_dir)."""
    folder = Path(output) if output else Path(cfg.reports_dir)
    folder.mkdir(parents=True, exist_ok=True)
    summary = heads_summary(cfg, domains)
    atomic_write_text(folder / "heads.json", json.dumps(summary, indent=2))
    return write_heads_md(summary, folder, domains)


def write_heads_md(summary: dict, folder: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS) -> Path:
    path = Path(folder) / "heads.md"
    atomic_write_text(path, render_heads_md(summary, domains))
    print(f"wrote {path}")
    return path


def rerender_heads_md(folder: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS) -> Path:
    """heads.md again from the heads.json of an earlier report in `folder` (no work dir needed)."""
    return write_heads_md(json.loads((Path(folder) / "heads.json").read_text()), folder, domains)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _label(h: dict) -> str:
    return f"{h['kind']}-{h['mixture']}"


def render_heads_md(s: dict, domains: Sequence[str]) -> str:
    return "\n".join([*_setting_md(s), *_budget_md(s), *_agreement_md(s, domains), *_comparison_md(s), *_features_md(s),
                      *_training_md(s, domains), *_method_md()])


def _precision(train: dict) -> str:
    precision = train.get("precision", "fp32")
    if precision == "bf16-mixed":
        return "with bf16 autocast (fp32 weights and optimizer)"
    if precision == "auto":
        return "with `train.precision: auto` (bf16 autocast on a GPU or a CPU with AMX, fp32 on other CPUs)"
    return "in fp32"


def _setting_md(s: dict) -> list[str]:
    t, f = s["train_config"], s["features_config"]
    config = f"configs/{s['config']}.yaml"
    machine = s["machine"] or "machine not recorded"
    return [
        f"# Draft heads — `{s['config']}` config",
        "",
        f"Target `{s['target']}` ({s['dtype']}), heads trained {_precision(t)} on the CPU ({machine}; threads per head in "
        "the training table: 1 means a Ray Tune trial or OMP_NUM_THREADS=1). "
        f"Regenerate with `taps heads-report --config {config}` once the heads are trained and measured (the sweep's "
        f"train stage, or `taps train` per head and then `taps agreement --config {config}`).",
        "",
        "Budget: " + ", ".join(_budget(name, m) for name, m in s["mixtures"].items()
                               if name in {h['mixture'] for h in s['heads']}) + "; "
        f"max_len {f['max_len']}, top-K {f['top_k']}, epochs {t['epochs']}, max_tokens {t['max_tokens']}, "
        f"batch {t['batch_size']}, lr {t['lr']:g} (warm-up {t['warmup_ratio']:g}, cosine), grad clip {t['grad_clip_value']:g} "
        f"by value, noise std {t['noise_std']:g}, HASS {t['hca_passes']} HCA passes and top-K weight {t['topk_weight']:g}, "
        f"held-out fraction {t['heldout_fraction']:g}, loss mask `{t['mask_alignment']}`." + (
            f" Target answers: every user turn answered by the target in order, greedy, at most "
            f"{f['regenerate_max_new_tokens']} new tokens per turn." if any(
                m.get("answers") == "target" for m in s["mixtures"].values()) else ""),
        "",
    ]


def _budget(name: str, m: dict) -> str:
    corpora = " + ".join(f"{c} {r:g}" for c, r in m["mixture"].items())
    return f"`{name}` {m['size']} conversations ({corpora}, {m.get('answers', 'dataset')} answers)"


def _budget_md(s: dict) -> list[str]:
    """What each head's budget bought: its data (conversations x epochs), its minutes, and the tau it drafts at."""
    if not any(h["state"] for h in s["heads"]):
        return []
    lines = ["## What each head's budget bought", "",
             "Conversations x epochs trained on (the held-out share excluded), the minutes its features and its "
             "training took, and its T = 0 tau on each domain's benchmarks (" + "; ".join(
                 f"{d}: {', '.join(b)}" for d, b in DOMAIN_BENCHMARKS.items()) + "; – before the sweep's evaluation). "
             "Feature minutes are the mixture's own extraction (0 when every conversation was copied from a larger "
             "mixture that holds it).", "",
             "| head | answers | conversations | epochs | trained tokens | feature min | train min | "
             + " | ".join(f"tau {d}" for d in DOMAIN_BENCHMARKS) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(DOMAIN_BENCHMARKS)]
    for h in s["heads"]:
        st, mixture = h["state"], s["mixtures"][h["mixture"]]
        if not st:
            continue
        features = s["features"].get(h["mixture"]) or {}
        computed = features.get("computed_tokens", features.get("tokens"))
        feature_min = (features.get("extract_s") or 0.0) / 60 if computed else 0.0
        epochs = st["tokens"] / max(1, st.get("epoch_size_tokens") or st["tokens"])
        taus = " | ".join(_fmt((h.get("tau") or {}).get(d), 2) for d in DOMAIN_BENCHMARKS)
        lines.append(f"| {_label(h)} | {mixture.get('answers', 'dataset')} | {mixture['size']} | {epochs:.1f} | "
                     f"{st['tokens']} | {feature_min:.1f} | {st['train_seconds'] / 60:.1f} | {taus} |")
    return [*lines, ""]


def _agreement_md(s: dict, domains: Sequence[str]) -> list[str]:
    lines = [
        "## Held-out next-token agreement with the target",
        "",
        "Top-1 of the head's draft equals the target's top-1, on the assistant tokens of the held-out "
        "conversations of each domain, with that mixture's answers (Budget above; the same conversations for every "
        "head, none of them trained on). "
        "`depth 1` is the first draft step (true target features); `depth 3` feeds the head its own two previous "
        "predictions (HASS harmonized context), the situation deeper in a draft tree.",
        "",
    ]
    header = "| head | trained on | " + " | ".join(f"{d} depth 1" for d in domains) + " | " + \
             " | ".join(f"{d} depth 3" for d in domains) + " |"
    lines += [header, "|" + "---|" * (2 + 2 * len(domains))]
    measured = [h for h in s["heads"] if h["agreement"]]
    for h in s["heads"]:
        a = h["agreement"]
        if not a:
            missing = NOT_MEASURED if h["state"] else NOT_TRAINED
            lines.append(f"| {_label(h)} | {h['mixture']} | " + " | ".join([missing] * (2 * len(domains))) + " |")
            continue
        best = [max(x["agreement"][d]["acc"] for x in measured if x["kind"] == h["kind"]) for d in domains]
        cells = [f"**{a[d]['acc']:.3f}**" if abs(a[d]["acc"] - b) < 1e-12 else f"{a[d]['acc']:.3f}"
                 for d, b in zip(domains, best)]
        deep = [_fmt(a[d].get("acc_2")) for d in domains]
        lines.append(f"| {_label(h)} | {h['mixture']} | " + " | ".join(cells) + " | " + " | ".join(deep) + " |")
    if measured:
        first = measured[0]["agreement"]
        lines += ["", "Scored tokens per domain: " + ", ".join(
            f"{d} {first[d]['tokens']} ({first[d]['conversations']} conversations)" for d in domains)
            + ". Bold: the best head of its kind on that domain.", ""]
    else:
        lines += ["", "No head's agreement is measured yet (`taps agreement`).", ""]
    own = []
    for h in measured:
        if h["mixture"] in domains:
            other = [d for d in domains if d != h["mixture"]]
            better = all(h["agreement"][h["mixture"]]["acc"] > x["agreement"][h["mixture"]]["acc"]
                         for x in measured if x["kind"] == h["kind"] and x["mixture"] in other)
            own.append(f"{_label(h)} {'beats' if better else 'does NOT beat'} the other-domain "
                       f"{h['kind']} head on {h['mixture']}")
    if own:
        lines += ["Specialisation: " + "; ".join(own) + ".", ""]
    return lines


def _comparison_md(s: dict) -> list[str]:
    rows = s.get("comparison") or []
    if not rows:
        return []
    lines = ["## Dataset answers vs target answers", "",
             "The same conversations (corpora, size and seed), trained once on the corpora's own answers (the "
             "paper's setting) and once on the target's own greedy answers. Agreement: as above, on the held-out "
             "conversations of the domain with the target's answers, i.e. what the target will say. Tau: new tokens "
             "per target step at T = 0 over the domain's benchmarks (" + "; ".join(
                 f"{d}: {', '.join(b)}" for d, b in DOMAIN_BENCHMARKS.items()) + "), from the sweep's evaluation "
             "(– before it ran).", "",
             "| domain | kind | heads (dataset / target answers) | agreement depth 1 dataset | target | "
             "depth 3 dataset | target | tau dataset | target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        heads = " / ".join(f"{r['kind']}-{r['heads'][a]}" for a in ("dataset", "target"))
        cells = [_fmt(r[key][a]) for key in ("acc", "acc_2", "tau") for a in ("dataset", "target")]
        lines.append(f"| {r['domain']} | {r['kind']} | {heads} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _features_md(s: dict) -> list[str]:
    lines = ["## Feature extraction", "",
             "| mixture | conversations | tokens | run through the target | copied from another mixture | seconds | "
             "tokens/s | tokens per CPU-second |", "|---|---|---|---|---|---|---|---|"]
    for name, st in s["features"].items():
        if st is None:
            lines.append(f"| {name} | {NOT_EXTRACTED} |" + " – |" * 6)
            continue
        computed = st.get("computed_tokens", st["tokens"])
        timing = (f"{_fmt(st.get('extract_s'), 1)} | {_fmt(st.get('tokens_per_s'), 0)} | "
                  f"{_fmt(st.get('tokens_per_cpu_s'), 0)}") if computed else "– | – | –"
        lines.append(f"| {name} | {st['conversations']} | {st['tokens']} | {computed} | "
                     f"{st.get('copied_conversations', 0)} conversations | {timing} |")
    lines += ["", "Tokens are all conversation tokens (prompt and answer) the target ran over, in right-padded "
              f"length-sorted batches of {s['features_config']['batch_size']}; the time covers the target forward, "
              "the LM head and the top-K. Tokens per CPU-second divide by the process's CPU time (all threads), a "
              "figure that other load on the machine disturbs much less than the wall-clock one.", ""]
    return lines


def _training_md(s: dict, domains: Sequence[str]) -> list[str]:
    lines = ["## Training", "",
             "| head | epochs | steps | trained tokens | threads | train seconds | tokens/s | tokens per CPU-second | "
             "held-out loss (own) | held-out agreement (own) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[str, list[float]] = {}
    for h in s["heads"]:
        st = h["state"]
        if not st:
            lines.append(f"| {_label(h)} | {NOT_TRAINED} |" + " – |" * 8)
            continue
        last = st["history"][-1] if st["history"] else {}
        secs, cpu = st["train_seconds"], st.get("train_cpu_seconds")
        group = "math + chat" if h["mixture"] in domains else h["mixture"]
        wall_cpu = groups.setdefault(group, [0.0, 0.0])
        wall_cpu[0] += secs
        wall_cpu[1] += cpu or 0.0
        epochs = st["tokens"] / max(1, st.get("epoch_size_tokens") or st["tokens"])
        lines.append(f"| {_label(h)} | {epochs:.2f} | {st['step']} | {st['tokens']} | {st.get('threads', '–')} | {secs:.0f} | "
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
        for m in (h["state"] or {}).get("history", []):
            per_epoch.append(f"| {_label(h)} | {m['epoch']} | {_fmt(m['train_loss'])} | "
                             f"{_fmt(m['heldout_loss'])} | {_fmt(m['heldout_acc'])} | {_fmt(m['tokens_per_s'], 0)} | "
                             f"{_fmt(m.get('tokens_per_cpu_s'), 0)} | {_fmt(m.get('load_average'), 1)} |")
    per_epoch += ["", "Train loss is the kind's own objective on the pass-0 batch (HASS: with its top-K term), so it is "
                  "not comparable across kinds; held-out loss is the EAGLE loss for both."]
    return [*lines, "### Per epoch", "", *per_epoch, ""]


def _method_md() -> list[str]:
    return ["## How these heads are trained", "",
            "* Features: `hidden_states[-1]` of the target (after its final norm) and its top-K next-token "
            "probabilities, from right-padded batches with the attention mask built from the lengths; "
            "assistant content plus its closing end-of-turn token carry the loss mask (docs/algorithms.md#loss-mask).",
            "* Position t gets (h_t + uniform noise · std · 512 / L, x_{t+1}) and regresses h_{t+1}; it is trained "
            "when the token it predicts, x_{t+2}, is an assistant token (`mask_alignment: predicted`; the "
            "reference's unshifted mask is `ref`). Losses are normalised by the mask sum.",
            "* EAGLE-2: SmoothL1 regression + 0.1 · soft cross-entropy against softmax(lm_head(h_{t+1})). HASS adds "
            "the top-K distillation term (stored target probabilities, not renormalised) and harmonized context "
            "alignment over the HCA passes, with a proper −inf mask (docs/algorithms.md#hass-harmonized-objective), gradients "
            "accumulated across passes.",
            "* Held-out: a conversation is held out when a hash of (seed, id) falls under the held-out fraction, "
            "the same rule in every mixture, so no head trained on any conversation scored above.",
            "* Answers: a mixture's `answers: dataset` trains on the corpora's own (human / GSM8K-train) answers, "
            "`answers: target` on the target's own greedy answers to every user turn in order, each turn seeing "
            "the target's earlier answers (docs/algorithms.md#target-answers); the generation pass is cached per "
            "conversation and resumable.", ""]
