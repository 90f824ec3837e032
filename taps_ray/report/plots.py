"""The report's figures (matplotlib, Agg). Each function writes one PNG, or returns a reason to skip it."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from taps_ray.eval.cell import PLAIN  # noqa: E402
from taps_ray.report.data import BENCH_LABELS, KIND_LABELS, PER_QUESTION, ReportData, averaged_weight  # noqa: E402
from taps_ray.report.tables import layout_rows  # noqa: E402
from taps_ray.report.uncertainty import CONFIDENCE, tau_interval  # noqa: E402

Plot = Callable[[ReportData, Path], "list[Path] | str"]


def _bench_label(bench: str) -> str:
    return BENCH_LABELS.get(bench, bench)


def proposer_colours(data: ReportData) -> dict[str, tuple]:
    """One colour per proposer for every figure of the report: plain, then the TAPS layout of every head kind, then
    any other proposer, each taking the next colour of tab20 (a proposer keeps its colour whatever subset a figure
    shows)."""
    order = [PLAIN]
    for kind in data.kinds:
        order += [p for p in [*layout_rows(data, kind), *sorted(data.proposers(kind))] if p not in order]
    palette = plt.get_cmap("tab20").colors
    return {name: palette[i % len(palette)] for i, name in enumerate(order)}


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                  intervals: dict[str, list[tuple[float, float] | None]] | None = None,
                  colours: dict[str, tuple] | None = None) -> None:
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        heights = [0.0 if math.isnan(v) else v for v in values]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=name,
                      color=(colours or {}).get(name))
        if intervals:
            spans = [span or (h, h) for span, h in zip(intervals[name], heights)]
            below = [max(h - low, 0.0) for h, (low, _) in zip(heights, spans)]
            above = [max(high - h, 0.0) for h, (_, high) in zip(heights, spans)]
            ax.errorbar([b.get_x() + b.get_width() / 2 for b in bars], heights, yerr=[below, above], fmt="none",
                        ecolor="black", elinewidth=0.7, capsize=1.5)
        for bar, value in zip(bars, values):
            if math.isnan(value):  # say "not measured" instead of drawing a zero
                ax.text(bar.get_x() + bar.get_width() / 2, 0, "–", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _measured(data: ReportData, kind: str, proposers: list[str], column: str) -> tuple[list[str], list[str]]:
    benches = [b for b in data.benchmarks if any(
        not math.isnan(data.value(kind, p, b, t, column)) for p in proposers for t in data.temperatures)]
    keep = [p for p in proposers if any(
        not math.isnan(data.value(kind, p, b, t, column)) for b in benches for t in data.temperatures)]
    return benches, keep


def _per_kind_bars(data: ReportData, out: Path, stem: str, column: str, ylabel: str, title: str,
                   include_plain: bool = False, baseline: float | None = None,
                   with_intervals: bool = False) -> list[Path] | str:
    paths, colours = [], proposer_colours(data)
    for kind in data.kinds:
        rows = [p for p in layout_rows(data, kind) if p in data.proposers(kind)]
        benches, rows = _measured(data, kind, ([PLAIN] if include_plain else []) + rows, column)
        if not rows:
            continue
        temps = data.temperatures
        width = max(5.5, 0.22 * len(benches) * len(rows) + 2)
        fig, axes = plt.subplots(1, len(temps), figsize=(width * len(temps) + 1.5, 4.5), squeeze=False, sharey=True)
        for ax, temperature in zip(axes[0], temps):
            series = {p: [data.value(kind, p, b, temperature, column) for b in benches] for p in rows}
            intervals = {p: [tau_interval(data.questions, "none" if p == PLAIN else kind, temperature, p, b)
                             for b in benches] for p in rows} if with_intervals else None
            _grouped_bars(ax, [_bench_label(b) for b in benches], series, ylabel,
                          f"{title} — {KIND_LABELS.get(kind, kind)}, T = {temperature:g}", intervals, colours)
            if all(math.isnan(v) for values in series.values() for v in values):
                ax.text(0.5, 0.5, _why_empty(data, kind, temperature, column), transform=ax.transAxes,
                        ha="center", va="center", fontsize=9, wrap=True)
            if baseline is not None:
                ax.axhline(baseline, color="black", linewidth=0.8, linestyle="--", label="plain decoding = 1×")
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="proposer")
        paths.append(_save(fig, out / f"{stem}_{kind}.png"))
    return paths or "no cells measured"


def _why_empty(data: ReportData, kind: str, temperature: float, column: str) -> str:
    """What an empty panel lacks: replayed cells have τ but no timing; otherwise the cells were not run."""
    replayed = any(m.get("replayed") and m["head_kind"] == kind and m["temperature"] == temperature
                   for m in data.meta)
    if replayed and column in ("speedup", "tokens_per_s"):
        return (f"not measured: the T = {temperature:g} cells are replayed\n(exact τ from one greedy decode per "
                "question, no timing);\nspeed is measured in live cells only")
    return f"no {kind} cells at T = {temperature:g}"


def plot_tau(data: ReportData, out: Path) -> list[Path] | str:
    return _per_kind_bars(data, out, "tau", "tau", f"acceptance length τ (tokens / step), {CONFIDENCE:.0%} CI",
                          "Acceptance length", with_intervals=True)


def plot_speedup(data: ReportData, out: Path) -> list[Path] | str:
    if data.summary.empty or data.summary["speedup"].isna().all():
        return "no plain-decoding baseline to compare with"
    return _per_kind_bars(data, out, "speedup", "speedup", "speedup over plain decoding (×)", "Speedup", baseline=1.0)


def plot_averaging(data: ReportData, out: Path) -> list[Path] | str:
    paths = []
    for kind in data.kinds:
        sweep = data.sweep(kind)
        if not sweep:
            continue
        temps = [t for t in data.temperatures
                 if any(not math.isnan(data.value(kind, p, b, t)) for _, p in sweep for b in data.benchmarks)]
        fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4.2), squeeze=False)
        for ax, temperature in zip(axes[0], temps):
            for bench in data.benchmarks:
                points = [(w, data.value(kind, p, bench, temperature)) for w, p in sweep]
                points = [(w, v) for w, v in points if not math.isnan(v)]
                if points:
                    ax.plot(*zip(*points), marker="o", label=_bench_label(bench))
            ax.set_xlabel("w = weight of the math head (w = 1: math head, w = 0: chat head)")
            ax.set_ylabel("acceptance length τ (tokens / step)")
            ax.set_title(f"Weight averaging sweep — {KIND_LABELS.get(kind, kind)}, T = {temperature:g}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, title="benchmark")
        paths.append(_save(fig, out / f"averaging_{kind}.png"))
    return paths or "no averaged-w<weight> cells such as averaged-w0.25 (the interpolation sweep was not run)"


def _by_kind(data: ReportData, frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Each head kind of the report with its rows of `frame`, kinds without rows left out: a figure per kind (an
    empty frame may lack the columns)."""
    parts = [(kind, frame[frame["head_kind"] == kind]) for kind in data.kinds] if not frame.empty else []
    return [(kind, part) for kind, part in parts if not part.empty]


def plot_routing(data: ReportData, out: Path) -> list[Path] | str:
    if data.routing.empty:
        return data.unmeasured("no confidence-routed or entropy-routed cells")
    paths = []
    for kind, part in _by_kind(data, data.routing):
        part = part[part["unit"] != "steps"]  # one unit per router: questions, or question turns (entropy routing)
        routers = [r for r in (PER_QUESTION, "confidence-routed", "entropy-routed") if r in set(part["proposer"])]
        if not routers:
            continue
        fig, axes = plt.subplots(1, len(routers), figsize=(6.5 * len(routers), 4.5), squeeze=False)
        for ax, router in zip(axes[0], routers):
            rows = part[part["proposer"] == router]
            groups = [(b, t) for t in sorted(set(rows["temperature"])) for b in data.benchmarks
                      if not rows[(rows["benchmark"] == b) & (rows["temperature"] == t)].empty]
            names = [*data.head_names, "merged"]  # a fixed colour per head across subplots and figures
            heads = sorted(set(rows["head"]), key=lambda h: (names.index(h) if h in names else len(names), h))
            colours = {h: f"C{names.index(h) if h in names else len(names) + i}" for i, h in enumerate(heads)}
            bottom = np.zeros(len(groups))
            for head in heads:
                values = np.array([rows[(rows["benchmark"] == b) & (rows["temperature"] == t) & (rows["head"] == head)]
                                   ["fraction"].sum() for b, t in groups])
                bars = ax.bar(range(len(groups)), values, 0.6, bottom=bottom, label=f"{head} head", color=colours[head])
                for bar, value, base in zip(bars, values, bottom):
                    if value >= 0.06:
                        ax.text(bar.get_x() + bar.get_width() / 2, base + value / 2, f"{value:.0%}", ha="center",
                                va="center", fontsize=8, color="white")
                bottom += values
            unit = rows["unit"].iloc[0]
            ax.set_xticks(range(len(groups)), [f"{_bench_label(b)}\nT={t:g}" for b, t in groups], fontsize=8)
            ax.set_ylim(0, 1)
            ax.set_xlim(-0.75, max(len(groups), 2) - 0.25)
            ax.set_ylabel(f"fraction of {unit} drafted by each head")
            ax.set_title(f"{router} (per {unit.removesuffix('s')}) — {KIND_LABELS.get(kind, kind)}")
            ax.legend(fontsize=8, title="head", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        paths.append(_save(fig, out / f"routing_{kind}.png"))
    return paths or "no routed cells"


def plot_entropy(data: ReportData, out: Path) -> list[Path] | str:
    paths = []
    for kind, part in _by_kind(data, data.entropy):
        temps = sorted(set(part["temperature"]))
        order = [p for p in layout_rows(data, kind) if p in set(part["proposer"])]
        order += sorted(set(part["proposer"]) - set(order), key=lambda p: (averaged_weight(p) is None, p))
        fig, axes = plt.subplots(1, len(temps), figsize=(max(7, 0.9 * len(order)) * len(temps) / 1.3, 4.5),
                                 squeeze=False, sharey=True)
        for ax, temperature in zip(axes[0], temps):
            rows = part[part["temperature"] == temperature].set_index("proposer")
            series = {
                group: [float(rows.loc[p, f"entropy_{group}"]) if p in rows.index else math.nan for p in order]
                for group in ("accepted", "rejected")
            }
            _grouped_bars(ax, order, series, "mean draft-node entropy (nats)",
                          f"Accepted vs rejected draft tokens — {KIND_LABELS.get(kind, kind)}, T = {temperature:g}")
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
            ax.set_ylim(top=1.25 * max([v for s in series.values() for v in s if not math.isnan(v)] + [0.1]))
            ax.legend(fontsize=8, title="draft nodes", loc="upper center", ncol=2)
        paths.append(_save(fig, out / f"entropy_{kind}.png"))
    return paths or data.unmeasured("no drafted nodes in the store")


PLOTS: dict[str, tuple[str, Plot]] = {
    "tau": (f"Acceptance length by proposer and benchmark ({CONFIDENCE:.0%} bootstrap CI over questions)", plot_tau),
    "averaging": ("Weight-averaging interpolation curve", plot_averaging),
    "routing": ("Routing fractions", plot_routing),
    "entropy": ("Accepted vs rejected draft-token entropy", plot_entropy),
    "speedup": ("Speedup over plain decoding", plot_speedup),
}
