"""Markdown tables of the report: acceptance length in the TAPS layout, speed, diagnostics, the paper's numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence

from taps_ray.eval.cell import PLAIN
from taps_ray.markdown import MISSING, fmt, md_table
from taps_ray.report.data import BENCH_LABELS, COMBINED, KIND_LABELS, OURS, ReportData, averaged_weight
from taps_ray.report.paper import PAPER_BENCHMARKS, PAPER_SOURCE, PAPER_TAU


def mean_or_nan(values: Sequence[float]) -> float:
    """The mean, or nan when any value is missing (an average over a partial row would mislead)."""
    return math.nan if not values or any(math.isnan(v) for v in values) else sum(values) / len(values)


def temp_label(temperature: float) -> str:
    return f"T = {temperature:g}"


def proposer_label(data: ReportData, proposer: str) -> str:
    if proposer in data.config.mixtures:
        corpora = " + ".join(f"{c} {r:.0%}" for c, r in data.config.mixtures[proposer].mixture.items())
        return f"{proposer} head ({corpora})"
    if proposer in OURS:
        return f"{proposer} (ours, not in TAPS)"
    return proposer


def layout_rows(data: ReportData, kind: str) -> list[str]:
    """TAPS row order: single heads (math, chat, mixtures), averaged, routers, merged, then our variants."""
    rows = [*data.single_heads, *COMBINED]
    extra = [p for p in data.proposers(kind) if p not in rows and averaged_weight(p) is None and p != PLAIN]
    return rows + extra


def measured_benchmarks(data: ReportData, kind: str, temperature: float, proposers: Sequence[str], column: str) -> list[str]:
    return [b for b in data.benchmarks
            if any(not math.isnan(data.value(kind, p, b, temperature, column)) for p in proposers)]


def tau_table(data: ReportData, kind: str, temperature: float, column: str = "tau", proposers: Sequence[str] | None = None,
              labels: dict[str, str] | None = None) -> str:
    proposers = list(proposers or layout_rows(data, kind))
    measured = measured_benchmarks(data, kind, temperature, proposers, column)
    rows = []
    for proposer in proposers:
        values = [data.value(kind, proposer, b, temperature, column) for b in data.benchmarks]
        average = mean_or_nan([data.value(kind, proposer, b, temperature, column) for b in measured])
        label = (labels or {}).get(proposer) or proposer_label(data, proposer)
        rows.append([label, *(fmt(v) for v in values), fmt(average)])
    header = ["drafter", *(BENCH_LABELS.get(b, b) for b in data.benchmarks), "Average"]
    note = "Average over " + (", ".join(BENCH_LABELS.get(b, b) for b in measured) or "no benchmark") + \
        " (the benchmarks measured in this table); – = not measured."
    return md_table(header, rows) + "\n\n" + note


def tau_tables(data: ReportData, column: str = "tau") -> str:
    parts = []
    for temperature in data.temperatures:
        for kind in data.kinds:
            parts.append(f"#### {KIND_LABELS.get(kind, kind)}, {temp_label(temperature)}\n\n{tau_table(data, kind, temperature, column)}")
    return "\n\n".join(parts) if parts else "No cells measured."


def averaging_sweep_tables(data: ReportData) -> str:
    parts = []
    for temperature in data.temperatures:
        for kind in data.kinds:
            sweep = data.sweep(kind)
            if not sweep:
                continue
            labels = {p: f"w = {w:g}" + ("" if averaged_weight(p) is not None else f" ({p} head)") for w, p in sweep}
            parts.append(f"#### {KIND_LABELS.get(kind, kind)}, {temp_label(temperature)}\n\n"
                         + tau_table(data, kind, temperature, "tau", [p for _, p in sweep], labels))
    return "\n\n".join(parts)


def speed_tables(data: ReportData) -> str:
    """tokens/s (speedup over plain) per proposer × benchmark; greedy match at T = 0."""
    parts = []
    for temperature in data.temperatures:
        for kind in data.kinds:
            proposers = [PLAIN, *(p for p in layout_rows(data, kind) if p in data.proposers(kind))]
            proposers += sorted((p for p in data.proposers(kind) if averaged_weight(p) is not None and p != "averaged"),
                                key=averaged_weight)
            rows = []
            for proposer in proposers:
                cells = []
                for bench in data.benchmarks:
                    tps = data.value(kind, proposer, bench, temperature, "tokens_per_s")
                    speedup = data.value(kind, proposer, bench, temperature, "speedup")
                    cell = MISSING if math.isnan(tps) else f"{tps:.1f} ({fmt(speedup, 2, '×')})"
                    match = data.value(kind, proposer, bench, temperature, "greedy_match")
                    if temperature == 0 and not math.isnan(match):  # replayed cells: no speed, but an agreement
                        cell += f" · {fmt(100 * match, 0, '%')}"
                    cells.append(cell)
                rows.append([proposer, *cells])
            header = ["proposer", *(BENCH_LABELS.get(b, b) for b in data.benchmarks)]
            parts.append(f"#### {KIND_LABELS.get(kind, kind)}, {temp_label(temperature)}\n\n{md_table(header, rows)}")
    if not parts:
        return "No cells measured."
    dtype = data.config.eval.dtype or data.config.target.dtype
    rounding = ("" if "32" in str(dtype) else
                f" In {dtype} that share is below 100% by rounding, not loss (the note after the tables says why); "
                "replayed cells share one greedy decode per question, so their share is the same for every proposer.")
    return ("Cells: tokens/s (speedup over plain decoding of the same prompts)"
            " · at T = 0, the share of answers token-identical to plain greedy decoding." + rounding + " "
            + speed_summary(data) + "\n\n" + "\n\n".join(parts))


def speed_summary(data: ReportData) -> str:
    """What the speed columns say and why: replayed cells have no timing; live speedups with their τ and the cost
    of a drafted step they imply (speedup = τ ÷ (drafted step time ÷ plain step time))."""
    summary = data.summary
    if summary.empty:
        return ""
    lines = []
    if any(meta.get("replayed") for meta in data.meta):
        lines.append("Speed: T = 0 cells of draft proposers are replayed (exact τ, no timing), so speedups come from "
                     "live cells only.")
    live = summary[(summary["proposer"] != PLAIN) & summary["speedup"].notna() & (summary["speedup"] > 0)]
    for temperature, rows in live.groupby("temperature"):
        cost = rows["tau"] / rows["speedup"]
        text = (f"Live at {temp_label(temperature)}: {rows['speedup'].min():.2f}–{rows['speedup'].max():.2f}× plain "
                f"decoding at τ {rows['tau'].min():.2f}–{rows['tau'].max():.2f}; a drafted step took "
                f"{cost.min():.1f}–{cost.max():.1f}× a plain step's time (τ ÷ speedup)")
        lines.append(text + (", more than the tokens it committed, so drafting did not pay on this machine."
                             if rows["speedup"].max() < 1 else "."))
    return " ".join(lines)


def entropy_md(data: ReportData) -> str:
    frame = data.entropy
    if frame.empty:
        return f"Not measured ({data.unmeasured('no drafted nodes in the store')})."
    rows = [[KIND_LABELS.get(r.head_kind, r.head_kind), r.proposer, temp_label(r.temperature), fmt(r.entropy_accepted, 3),
             fmt(r.entropy_rejected, 3), fmt(r.delta_entropy, 3), f"{int(r.n_accepted)} / {int(r.n_rejected)}"]
            for r in frame.itertuples()]
    header = ["head kind", "proposer", "T", "accepted (nats)", "rejected (nats)", "Δ rejected − accepted", "nodes acc / rej"]
    return md_table(header, rows)


def routing_md(data: ReportData) -> str:
    frame = data.routing
    if frame.empty:
        return f"Not measured ({data.unmeasured('no confidence-routed or entropy-routed cells')})."
    rows = []
    for (kind, proposer, temperature, unit), group in frame.groupby(["head_kind", "proposer", "temperature", "unit"], sort=True):
        for bench in data.benchmarks:
            part = group[group["benchmark"] == bench]
            if part.empty:
                continue
            shares = ", ".join(f"{r.head} {r.fraction:.0%}" for r in part.itertuples())
            rows.append([KIND_LABELS.get(kind, kind), proposer, temp_label(temperature), BENCH_LABELS.get(bench, bench),
                         f"{shares} of {unit}"])
    return md_table(["head kind", "router", "T", "benchmark", "drafted by"], rows)


def paper_tables() -> str:
    parts = [f"Source: {PAPER_SOURCE}. Cells: HASS / EAGLE-2. These are **not** our measurements."]
    header = ["drafter", *(BENCH_LABELS[b] for b in PAPER_BENCHMARKS), "Average"]
    for temperature, table in PAPER_TAU.items():
        rows = [[name, *(f"{h:.2f} / {e:.2f}" for h, e in cells)] for name, cells in table.items()]
        parts.append(f"#### Paper, {temp_label(temperature)}\n\n{md_table(header, rows)}")
    return "\n\n".join(parts)


def failures_md(data: ReportData) -> str:
    if not data.failures:
        return "None."
    rows = []
    for failure in data.failures:
        first = (str(failure.get("error", "")).strip().splitlines() or [""])[0]
        temperature = failure.get("temperature")
        cell = f"{failure.get('head_kind')} / {failure.get('proposer')} / {failure.get('benchmark')} / T={temperature}"
        rows.append([cell, str(failure.get("attempts", "")), f"`{first}`"])
    return md_table(["cell (head kind / proposer / benchmark / T)", "attempts", "error"], rows)
