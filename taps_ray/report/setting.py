"""The setting block: target, data sources and sizes, tree, hardware, date, commit, how to regenerate."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from taps_ray.data.sources import DataUnavailable, resolve
from taps_ray.machine import cpu_line
from taps_ray.markdown import git_commit
from taps_ray.relpaths import shown_path
from taps_ray.report.data import BENCH_LABELS, ReportData


def _source(name: str, data_dir: Path | None) -> tuple[str, bool]:
    try:
        source = resolve(name, data_dir)
    except DataUnavailable:
        return "unavailable on the machine that built this report", False
    return source.source_label, source.stand_in


def _distinct(meta: list[dict], key: str) -> str:
    values = sorted({str(m[key]) for m in meta if m.get(key) not in (None, "")})
    return ", ".join(values)


def setting_md(data: ReportData, command: str, regenerate: str | None = None) -> str:
    """The setting list; `regenerate`: the `taps report` command that rebuilds this report (default: `command`)."""
    regenerate = regenerate or command
    config = data.config
    data_dir = config.resolved_data_dir()
    eval_dtype = config.eval.dtype or config.target.dtype
    stored_dtype = _distinct(data.meta, "dtype")
    lines = [
        f"- **Study**: `{config.name}`; results store `{shown_path(data.store_root) if data.store_root else 'none'}`.",
        f"- **Target**: `{config.target.name}`, evaluated in {eval_dtype}"
        + (f" (dtype recorded by the cells: {stored_dtype})" if stored_dtype else "") + ".",
        f"- **Draft heads**: {', '.join(config.train.kinds)}; {config.train.epochs} epoch(s), lr {config.train.lr:g}, "
        f"features max_len {config.features.max_len}.",
    ]
    corpora = sorted({c for m in config.mixtures.values() for c in m.mixture})
    stand_in = False
    sources = []
    for corpus in corpora:
        label, is_stand_in = _source(corpus, data_dir)
        stand_in |= is_stand_in and corpus == "mathinstruct"
        sources.append(f"`{corpus}`: {label}")
    lines.append("- **Training data sources**: " + "; ".join(sources) + ".")
    mixes = [
        f"`{name}` = " + " + ".join(f"{c} {r:.0%}" for c, r in m.mixture.items()) + f", {m.size} conversations (seed {m.seed})"
        for name, m in config.mixtures.items()
    ]
    lines.append("- **Mixtures**: " + "; ".join(mixes) + ".")
    if stand_in:
        lines.append(
            "- **Note**: MathInstruct has no offline copy, so the *math* corpus here is the GSM8K **train** split "
            "(a stand-in, not MathInstruct). The math head therefore saw GSM8K-style problems, which favours it on "
            "GSM8K more than MathInstruct would."
        )
    evals = []
    live = config.eval.live_questions
    for bench, count in config.eval.benchmarks.items():
        label, _ = _source(bench, data_dir)
        shown = f"first {count} questions" + (f" (first {live} in live cells)" if live and live < count else "")
        evals.append(f"{BENCH_LABELS.get(bench, bench)}: {shown} ({label})")
    lines.append("- **Evaluation sets**: " + "; ".join(evals) + ".")
    if config.eval.replay:
        lines.append(
            "- **Replay**: T = 0 cells of draft proposers are replayed from one greedy decode per question (exact; "
            "docs/algorithms.md#replay), so they report τ but no speed; plain decoding and T > 0 cells run live"
            + (f" on the first {live} questions" if live else "")
            + (f", T > 0 with {', '.join(config.eval.live_proposers)}" if config.eval.live_proposers else "")
            + "."
        )
    tree = config.tree
    lines += [
        f"- **Tree**: total_token {tree.total_token}, depth {tree.depth}, top_k {tree.top_k} (TAPS: 60 / 5 / 10)"
        + (f"; draft vocabulary {tree.draft_vocab_size} tokens (draft confidence and entropy, hence routing and the "
           "entropy diagnostics, are of the head's distribution renormalised on these tokens, not on the full "
           "vocabulary as in TAPS)" if getattr(tree, "draft_vocab_size", None) else "")
        + ".",
        f"- **Decoding**: temperatures {', '.join(f'{t:g}' for t in config.eval.temperatures)}; max_new_tokens "
        f"{config.eval.max_new_tokens}; batch {config.eval.batch_size}; seed {config.eval.seed}.",
        f"- **Hardware** (machine that built this report): {cpu_line()}"
        + (f"; evaluation device recorded by the cells: {_distinct(data.meta, 'device')}" if _distinct(data.meta, "device") else "")
        + ".",
        f"- **Date**: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; **git commit**: `{git_commit()}`.",
        f"- **Regenerate**: `{regenerate}` rebuilds this report alone from its `results/` copy (no runs/ needed)"
        + ("." if command == regenerate else f"; `{command}` produced it (`make sweep` reruns the whole study)."),
    ]
    return "\n".join(lines)
