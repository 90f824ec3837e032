"""The TAPS claims, each checked against our numbers: HOLDS / DOES NOT HOLD / NOT MEASURED, with the figures.

A claim is checked separately in every setting (head kind × temperature) where its cells exist. It HOLDS when it
holds in every measured setting, DOES NOT HOLD when it fails in at least one (the count says how many), and is
NOT MEASURED when no setting has the cells it needs. The verdict follows the point estimates; each τ comparison
also carries a paired bootstrap interval, and the claim line counts how many comparisons are clear either way and
how many are within noise, so a reader can tell a real reversal from a coin flip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from taps_ray.report.data import BENCH_LABELS, KIND_LABELS, ReportData
from taps_ray.report.paper import PAPER_ENTROPY_GAP_NATS, PAPER_ROUTING
from taps_ray.report.uncertainty import CONFIDENCE, Interval, tau_difference

HOLDS, FAILS, UNMEASURED = "HOLDS", "DOES NOT HOLD", "NOT MEASURED"
MATH_BENCHES = ("gsm8k", "math_500", "svamp")
NEAR_BEST = 0.02  # "near-best": an average within 2% of the best one


@dataclass
class Finding:
    key: str
    claim: str
    paper: str
    verdict: str = UNMEASURED
    evidence: list[str] = field(default_factory=list)
    settings: list[tuple[str, float, bool]] = field(default_factory=list)  # (kind, T, holds)
    intervals: list[Interval] = field(default_factory=list)  # oriented: Δ > 0 favours the claim

    def add(self, kind: str, temperature: float, holds: bool, text: str, intervals: list[Interval] = ()) -> None:
        self.settings.append((kind, temperature, holds))
        self.intervals.extend(intervals)
        self.evidence.append(f"{KIND_LABELS.get(kind, kind)}, T = {temperature:g}: {HOLDS if holds else FAILS} — {text}")

    def decide(self, reason: str = "") -> "Finding":
        if not self.settings:
            self.verdict = UNMEASURED
            if reason:
                self.evidence.insert(0, reason)
        else:
            self.verdict = HOLDS if all(h for _, _, h in self.settings) else FAILS
        return self

    def markdown(self) -> str:
        count = ""
        if self.settings:
            count = f" (holds in {sum(h for *_, h in self.settings)} of {len(self.settings)} settings)"
        if self.intervals:
            signs = [i.sign for i in self.intervals]
            count += (f"; τ comparisons ({len(signs)}): {signs.count(1)} clearly for the claim, "
                      f"{signs.count(-1)} clearly against it, {signs.count(0)} within noise")
            if self.verdict == FAILS and -1 not in signs:
                count += ", so every failure is within noise"
        lines = [f"- **({self.key}) {self.claim}: {self.verdict}**{count}. Paper: {self.paper}."]
        lines += [f"  - {line}" for line in self.evidence]
        return "\n".join(lines)


def _settings(data: ReportData) -> Iterator[tuple[str, float]]:
    for kind in data.kinds:
        for temperature in data.temperatures:
            yield kind, temperature


def _b(bench: str) -> str:
    return BENCH_LABELS.get(bench, bench)


def _mark(ok: bool, tie: bool) -> str:
    return "✓" + (" (tie)" if tie else "") if ok else "✗" + (" (tie)" if tie else "")


def _common_average(data: ReportData, kind: str, temperature: float, proposers: list[str]) -> tuple[list[str], dict[str, float]]:
    """Mean τ of each proposer over the benchmarks where all of them were measured."""
    benches = [b for b in data.benchmarks if all(not math.isnan(data.value(kind, p, b, temperature)) for p in proposers)]
    if not benches:
        return [], {}
    return benches, {p: sum(data.value(kind, p, b, temperature) for b in benches) / len(benches) for p in proposers}


def _difference(data: ReportData, kind: str, temperature: float, a: str, b: str, benches: list[str]) -> Interval | None:
    return tau_difference(data.questions, kind, temperature, a, b, benches)


def _noise(interval: Interval | None) -> str:
    return f" ({interval.text()})" if interval else ""


def _measured(data: ReportData, kind: str, temperature: float, proposer: str) -> bool:
    return any(not math.isnan(data.value(kind, proposer, b, temperature)) for b in data.benchmarks)


def specialisation(data: ReportData) -> Finding:
    finding = Finding("a", "The math head beats the chat head on GSM8K, MATH-500 and SVAMP, and the chat head beats the "
                      "math head on MT-Bench", "e.g. EAGLE-2 T = 0 GSM8K 5.04 vs 3.72, MT-Bench 2.54 vs 3.57")
    math_head, chat_head = data.specialist("mathinstruct"), data.specialist("sharegpt")
    if not (math_head and chat_head):
        return finding.decide("no head trained on mathinstruct alone and one on sharegpt alone")
    for kind, temperature in _settings(data):
        checks, intervals = [], []
        for bench in (*MATH_BENCHES, "mt_bench"):
            m, c = data.value(kind, math_head, bench, temperature), data.value(kind, chat_head, bench, temperature)
            if math.isnan(m) or math.isnan(c):
                continue
            ok = c > m if bench == "mt_bench" else m > c
            interval = _difference(data, kind, temperature, math_head, chat_head, [bench])
            if interval:
                intervals.append(interval.flipped() if bench == "mt_bench" else interval)
            checks.append((ok, f"{_b(bench)} math {m:.2f} vs chat {c:.2f} {_mark(ok, m == c)}{_noise(interval)}"))
        if checks:
            finding.add(kind, temperature, all(ok for ok, _ in checks), "; ".join(text for _, text in checks),
                        intervals)
    return finding.decide("math and chat heads not evaluated on a common benchmark")


def robustness(data: ReportData) -> Finding:
    finding = Finding("b", "A mixture head is the most robust single head (best or near-best average τ; near-best = "
                      f"within {NEAR_BEST:.0%} of the best)", "Mixed 70k+70k has the best single-head average at T = 0")
    mixtures = data.mixture_heads
    if not mixtures:
        return finding.decide("no head trained on a mixture of corpora in this config")
    for kind, temperature in _settings(data):
        heads = [h for h in data.single_heads if _measured(data, kind, temperature, h)]
        if len(heads) < 2 or not set(heads) & set(mixtures):
            continue
        benches, averages = _common_average(data, kind, temperature, heads)
        if not benches:
            continue
        best = max(averages, key=averages.get)
        mixture = max((h for h in heads if h in mixtures), key=averages.get)
        ok = averages[mixture] >= averages[best] * (1 - NEAR_BEST)
        text = ", ".join(f"{h} {averages[h]:.2f}" for h in heads)
        gap = (averages[best] - averages[mixture]) / averages[best] if averages[best] else 0.0
        verdict = (f"best: {mixture}" if mixture == best else f"best: {best}; {mixture} is {gap:.1%} below it"
                   f"{_noise(_difference(data, kind, temperature, mixture, best, benches))}")
        finding.add(kind, temperature, ok, f"average τ over {', '.join(map(_b, benches))}: {text}; {verdict}")
    return finding.decide("no mixture head evaluated next to another single head")


def _pairwise(data: ReportData, finding: Finding, winners: list[str], loser: str, strict: bool) -> Finding:
    for kind, temperature in _settings(data):
        checks, intervals = [], []
        for winner in winners:
            benches, averages = _common_average(data, kind, temperature, [winner, loser])
            if not benches:
                continue
            ok = averages[winner] > averages[loser] if strict else averages[winner] >= averages[loser]
            interval = _difference(data, kind, temperature, winner, loser, benches)
            intervals += [interval] if interval else []
            checks.append((ok, f"{winner} {averages[winner]:.2f} vs {loser} {averages[loser]:.2f} "
                               f"(average over {', '.join(map(_b, benches))}) "
                               f"{_mark(ok, averages[winner] == averages[loser])}{_noise(interval)}"))
        if checks:
            finding.add(kind, temperature, all(ok for ok, _ in checks), "; ".join(text for _, text in checks),
                        intervals)
    return finding.decide(f"{' / '.join(winners)} and {loser} not evaluated on a common benchmark")


def beats_averaging(data: ReportData) -> Finding:
    finding = Finding("c", "Confidence routing and merged trees beat weight averaging (average τ)",
                      "EAGLE-2 T = 0 averages 4.63 (routed) and 5.02 (merged) vs 2.42 (averaged)")
    return _pairwise(data, finding, ["confidence-routed", "merged"], "averaged", strict=True)


def confidence_vs_entropy(data: ReportData) -> Finding:
    finding = Finding("d", "Confidence routing is at least as good as entropy routing (average τ)",
                      "not tabulated in the README; the authors prefer confidence routing")
    return _pairwise(data, finding, ["confidence-routed"], "entropy-routed", strict=False)


def entropy_gap(data: ReportData) -> Finding:
    low, high = PAPER_ENTROPY_GAP_NATS
    finding = Finding("e", "Rejected draft tokens have higher entropy than accepted ones (Δ = rejected − accepted > 0)",
                      f"Δ = {low}–{high} nats")
    frame = data.entropy
    for kind, temperature in _settings(data):
        rows = frame[(frame["head_kind"] == kind) & (frame["temperature"] == temperature)
                     & (frame["n_accepted"] > 0) & (frame["n_rejected"] > 0)] if not frame.empty else frame
        if rows.empty:
            continue
        rows = rows.sort_values("delta_entropy")
        lo, hi = rows.iloc[0], rows.iloc[-1]
        failing = [f"{r.proposer} {r.delta_entropy:+.3f}" for r in rows.itertuples() if not r.delta_entropy > 0]
        text = (f"Δ from {lo.delta_entropy:+.3f} nats ({lo.proposer}) to {hi.delta_entropy:+.3f} nats ({hi.proposer}) "
                f"over {len(rows)} proposers")
        if failing:
            text += f"; Δ ≤ 0 for {', '.join(failing)}"
        finding.add(kind, temperature, not failing, text)
    return finding.decide("no cell had both accepted and rejected drafted nodes")


def routing(data: ReportData) -> Finding:
    finding = Finding("f", "Confidence routing sends most GSM8K steps to the math head and most MT-Bench steps to the "
                      "chat head", f"{PAPER_ROUTING['gsm8k_to_math']:.1%} of GSM8K to math, "
                      f"{PAPER_ROUTING['mt_bench_to_chat']:.1%} of MT-Bench to chat")
    math_head, chat_head = data.specialist("mathinstruct"), data.specialist("sharegpt")
    frame = data.routing
    if frame.empty or not (math_head and chat_head):
        return finding.decide("no confidence-routed cells" if frame.empty else "no math and chat specialist heads")

    def share(kind: str, temperature: float, proposer: str, bench: str, head: str) -> float:
        rows = frame[(frame["head_kind"] == kind) & (frame["temperature"] == temperature)
                     & (frame["proposer"] == proposer) & (frame["benchmark"] == bench)]
        return float(rows.loc[rows["head"] == head, "fraction"].sum()) if not rows.empty else math.nan

    for kind, temperature in _settings(data):
        checks = []
        for bench, head in (("gsm8k", math_head), ("mt_bench", chat_head)):
            value = share(kind, temperature, "confidence-routed", bench, head)
            if not math.isnan(value):
                checks.append((value > 0.5, f"{_b(bench)} {value:.0%} of steps to {head} {'✓' if value > 0.5 else '✗'}"))
        if not checks:
            continue
        extra = []
        for bench, head in (("gsm8k", math_head), ("mt_bench", chat_head)):
            value = share(kind, temperature, "entropy-routed", bench, head)
            if not math.isnan(value):
                extra.append(f"{_b(bench)} {value:.0%} of question turns to {head}")
        text = "; ".join(t for _, t in checks) + (f" (entropy routing, not judged: {'; '.join(extra)})" if extra else "")
        finding.add(kind, temperature, all(ok for ok, _ in checks), text)
    return finding.decide("no confidence-routed cell on GSM8K or MT-Bench")


CLAIMS: list[Callable[[ReportData], Finding]] = [
    specialisation, robustness, beats_averaging, confidence_vs_entropy, entropy_gap, routing,
]


def findings(data: ReportData) -> list[Finding]:
    return [claim(data) for claim in CLAIMS]


def findings_md(data: ReportData, results: list[Finding] | None = None) -> str:
    results = results if results is not None else findings(data)
    summary = data.summary
    scale = ""
    if not summary.empty:
        low, high = summary["n_questions"].min(), summary["n_questions"].max()
        scale = (f" Each cell holds {low if low == high else f'{low}–{high}'} questions. Every τ comparison carries "
                 f"Δ and its {CONFIDENCE:.0%} interval from a paired bootstrap over questions (resampled within each "
                 "benchmark, the same resample for both proposers); an interval that straddles zero means the "
                 "difference is within the noise of this many questions.")
    intro = ("Each TAPS claim checked against the tables above, separately per head kind × temperature. "
             "HOLDS = holds in every setting where it was measured." + scale)
    return intro + "\n\n" + "\n".join(f.markdown() for f in results)
