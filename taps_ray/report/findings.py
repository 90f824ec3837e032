"""The TAPS claims, each checked against our numbers: HOLDS / DOES NOT HOLD / WITHIN NOISE / NOT MEASURED.

A claim is checked separately in every setting (head kind × temperature) where its cells exist, and every check
carries a bootstrap interval over questions (paired where two proposers decode the same questions), oriented so
that Δ > 0 favours the claim. A setting HOLDS when every interval lies above zero, DOES NOT HOLD when any lies
below, and is WITHIN NOISE otherwise. The claim HOLDS when every measured setting holds, DOES NOT HOLD when one
fails, MOSTLY HOLDS when none fails and more than half hold, is WITHIN NOISE otherwise, and NOT MEASURED when no
setting has its cells. Each check's mark is its interval's: ✓ above zero, ✗ below, ≈ straddling it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pandas as pd

from taps_ray.report.data import BENCH_LABELS, KIND_LABELS, PER_QUESTION, ReportData
from taps_ray.report.paper import PAPER_ENTROPY_GAP_NATS, PAPER_ROUTING
from taps_ray.report.uncertainty import (
    CONFIDENCE, Interval, Term, entropy_gap as gap_interval, share_above, tau_contrast, tau_difference,
)

HOLDS, MOSTLY, FAILS, NOISE, UNMEASURED = "HOLDS", "MOSTLY HOLDS", "DOES NOT HOLD", "WITHIN NOISE", "NOT MEASURED"
MATH_BENCHES = ("gsm8k", "math_500", "svamp")
NEAR_BEST = 0.02  # "near-best": an average within 2% of the best one


@dataclass
class Finding:
    key: str
    claim: str
    paper: str
    verdict: str = UNMEASURED
    evidence: list[str] = field(default_factory=list)
    settings: list[tuple[str, float, str]] = field(default_factory=list)  # (kind, T, HOLDS / FAILS / NOISE)
    intervals: list[Interval] = field(default_factory=list)  # oriented: Δ > 0 favours the claim
    checks: list[tuple[str, Interval]] = field(default_factory=list)  # (where, interval), for the summary

    def add(self, kind: str, temperature: float, text: str, intervals: list[Interval | None],
            labels: list[str] | None = None) -> None:
        """One setting, decided by its intervals (a check without one, e.g. a single question, is within noise).
        `labels`: what each interval compares (a benchmark, a proposer), named in the summary."""
        signs = [i.sign if i else 0 for i in intervals]
        status = FAILS if -1 in signs else HOLDS if signs and all(x == 1 for x in signs) else NOISE
        setting = f"{KIND_LABELS.get(kind, kind)}, T = {temperature:g}"
        self.settings.append((kind, temperature, status))
        self.intervals.extend(i for i in intervals if i)
        self.checks += [(f"{setting}{f' {label}' if label else ''}", i)
                        for i, label in zip(intervals, labels or [""] * len(intervals)) if i]
        self.evidence.append(f"{setting}: {status} — {text}")

    def decide(self, reason: str = "") -> "Finding":
        statuses = [status for *_, status in self.settings]
        if not statuses:
            self.verdict = UNMEASURED
            if reason:
                self.evidence.insert(0, reason)
        elif FAILS in statuses:
            self.verdict = FAILS
        elif all(x == HOLDS for x in statuses):
            self.verdict = HOLDS
        else:
            self.verdict = MOSTLY if statuses.count(HOLDS) > len(statuses) / 2 else NOISE
        return self

    def deciding(self) -> str:
        """The check that decides the verdict: the interval against the claim, else the one closest to zero."""
        if not self.checks:
            return "no interval (too few questions)"
        against = [c for c in self.checks if c[1].sign == -1]
        undecided = [c for c in self.checks if c[1].sign == 0]
        if against:
            where, interval = min(against, key=lambda c: c[1].high)
            return f"against it: {where} {interval.text()}"
        if undecided:
            where, interval = min(undecided, key=lambda c: c[1].low)
            more = f" (and {len(undecided) - 1} more)" if len(undecided) > 1 else ""
            return f"within noise: {where} {interval.text()}{more}"
        where, interval = min(self.checks, key=lambda c: c[1].low)
        return f"every interval above zero, the closest: {where} {interval.text()}"

    def summary_line(self) -> str:
        held = [status for *_, status in self.settings]
        if not held:
            return f"- **({self.key}) {self.verdict}**: {self.claim} ({'; '.join(self.evidence) or 'no cells'})."
        count = (f" (holds in {held.count(HOLDS)} of {len(held)} settings, {held.count(NOISE)} within noise, "
                 f"{held.count(FAILS)} against)" if self.verdict != HOLDS else "")
        return f"- **({self.key}) {self.verdict}**{count}: {self.claim}. Deciding check, {self.deciding()}."

    def markdown(self) -> str:
        count = ""
        if self.settings:
            statuses = [status for *_, status in self.settings]
            count = f" (holds in {statuses.count(HOLDS)} of {len(statuses)} settings, {statuses.count(NOISE)} within noise)"
        if self.intervals:
            signs = [i.sign for i in self.intervals]
            count += (f"; intervals ({len(signs)}): {signs.count(1)} clearly for the claim, "
                      f"{signs.count(-1)} clearly against it, {signs.count(0)} within noise")
        lines = [f"- **({self.key}) {self.claim}: {self.verdict}**{count}. Paper: {self.paper}."]
        lines += [f"  - {line}" for line in self.evidence]
        return "\n".join(lines)


def _settings(data: ReportData) -> Iterator[tuple[str, float]]:
    for kind in data.kinds:
        for temperature in data.temperatures:
            yield kind, temperature


def _b(bench: str) -> str:
    return BENCH_LABELS.get(bench, bench)


def _mark(interval: Interval | None, ok: bool) -> str:
    """The check's mark, its interval's verdict: ✓ for the claim, ✗ against it, ≈ within noise; without an
    interval (one question), the point estimate's direction, marked as such."""
    if interval is None:
        return f"{'✓' if ok else '✗'} (point estimate only)"
    return {1: "✓", -1: "✗", 0: "≈"}[interval.sign]


def _common_average(data: ReportData, kind: str, temperature: float, proposers: list[str]) -> tuple[list[str], dict[str, float]]:
    """Mean τ of each proposer over the benchmarks where all of them were measured."""
    benches = [b for b in data.benchmarks if all(not math.isnan(data.value(kind, p, b, temperature)) for p in proposers)]
    if not benches:
        return [], {}
    return benches, {p: sum(data.value(kind, p, b, temperature) for b in benches) / len(benches) for p in proposers}


def _difference(data: ReportData, kind: str, temperature: float, a: str, b: str, benches: list[str],
                scale: float = 1.0) -> Interval | None:
    return tau_difference(data.questions, kind, temperature, a, b, benches, scale=scale)


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
        checks, intervals, labels = [], [], []
        for bench in (*MATH_BENCHES, "mt_bench"):
            m, c = data.value(kind, math_head, bench, temperature), data.value(kind, chat_head, bench, temperature)
            if math.isnan(m) or math.isnan(c):
                continue
            interval = _difference(data, kind, temperature, math_head, chat_head, [bench])
            if bench == "mt_bench":  # the chat head's benchmark: Δ = chat − math, so Δ > 0 favours the claim here too
                interval = interval.flipped() if interval else None
                checks.append(f"{_b(bench)} chat {c:.2f} vs math {m:.2f} {_mark(interval, c > m)}{_noise(interval)}")
            else:
                checks.append(f"{_b(bench)} math {m:.2f} vs chat {c:.2f} {_mark(interval, m > c)}{_noise(interval)}")
            intervals.append(interval)
            labels.append(_b(bench))
        if checks:
            finding.add(kind, temperature, "; ".join(checks), intervals, labels)
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
        rival = max((h for h in heads if h != mixture), key=averages.get)  # the best other head
        ok = averages[mixture] >= averages[rival] * (1 - NEAR_BEST)
        interval = _difference(data, kind, temperature, mixture, rival, benches, scale=1 - NEAR_BEST)
        text = ", ".join(f"{h} {averages[h]:.2f}" for h in heads)
        gap = (averages[best] - averages[mixture]) / averages[best] if averages[best] else 0.0
        verdict = (f"best: {mixture}" if mixture == best else f"best: {best}; {mixture} is {gap:.1%} below it")
        finding.add(kind, temperature, f"average τ over {', '.join(map(_b, benches))}: {text}; {verdict}; "
                    f"{mixture} − {1 - NEAR_BEST:g} × {rival} {_mark(interval, ok)}{_noise(interval)}", [interval])
    return finding.decide("no mixture head evaluated next to another single head")


def _pairwise(data: ReportData, finding: Finding, winners: list[str], loser: str, strict: bool) -> Finding:
    for kind, temperature in _settings(data):
        checks, intervals, labels = [], [], []
        for winner in winners:
            benches, averages = _common_average(data, kind, temperature, [winner, loser])
            if not benches:
                continue
            ok = averages[winner] > averages[loser] if strict else averages[winner] >= averages[loser]
            interval = _difference(data, kind, temperature, winner, loser, benches)
            intervals.append(interval)
            labels.append(f"{winner} vs {loser}")
            checks.append(f"{winner} {averages[winner]:.2f} vs {loser} {averages[loser]:.2f} "
                          f"(average over {', '.join(map(_b, benches))}) {_mark(interval, ok)}{_noise(interval)}")
        if checks:
            finding.add(kind, temperature, "; ".join(checks), intervals, labels)
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
    sums = data.node_sums
    if sums.empty:
        return finding.decide(data.unmeasured("no cell had both accepted and rejected drafted nodes"))
    for kind, temperature in _settings(data):
        setting = sums[(sums["head_kind"] == kind) & (sums["temperature"] == temperature)]
        gaps = {p: gap_interval(g) for p, g in setting.groupby("proposer", sort=True)}  # drafted proposers only
        gaps = {p: i for p, i in gaps.items() if i}
        if not gaps:
            continue
        order = sorted(gaps, key=lambda p: gaps[p].delta)
        text = (f"Δ from {gaps[order[0]].delta:+.3f} nats ({order[0]}) to {gaps[order[-1]].delta:+.3f} nats "
                f"({order[-1]}) over {len(gaps)} proposers")
        failing = [f"{p} {gaps[p].text()}" for p in order if gaps[p].sign != 1]
        if failing:
            text += f"; not clearly > 0: {', '.join(failing)}"
        finding.add(kind, temperature, text, list(gaps.values()), list(gaps))
    return finding.decide("no cell had both accepted and rejected drafted nodes")


def routing(data: ReportData) -> Finding:
    finding = Finding("f", "Confidence routing sends most GSM8K questions to the math head and most MT-Bench questions "
                      "to the chat head", f"{PAPER_ROUTING['gsm8k_to_math']:.1%} of GSM8K to math, "
                      f"{PAPER_ROUTING['mt_bench_to_chat']:.1%} of MT-Bench to chat (share of questions)")
    math_head, chat_head = data.specialist("mathinstruct"), data.specialist("sharegpt")
    per_question, frame = data.question_routing, data.routing
    if per_question.empty or not (math_head and chat_head):
        return finding.decide(data.unmeasured("no routed questions") if per_question.empty
                              else "no math and chat specialist heads")

    def picks(kind: str, temperature: float, router: str, bench: str) -> pd.Series:
        return per_question.loc[(per_question["head_kind"] == kind) & (per_question["temperature"] == temperature)
                                & (per_question["router"] == router) & (per_question["benchmark"] == bench), "head"]

    def step_share(kind: str, temperature: float, bench: str, head: str) -> float:
        rows = frame[(frame["head_kind"] == kind) & (frame["temperature"] == temperature) & (frame["unit"] == "steps")
                     & (frame["proposer"] == "confidence-routed") & (frame["benchmark"] == bench)]
        return float(rows.loc[rows["head"] == head, "fraction"].sum()) if not rows.empty else math.nan

    for kind, temperature in _settings(data):
        checks, intervals, labels = [], [], []
        for bench, head in (("gsm8k", math_head), ("mt_bench", chat_head)):
            judged = picks(kind, temperature, PER_QUESTION, bench)
            router = PER_QUESTION
            if judged.empty:  # no single-head cells of both heads: the per-step router's majority per question
                judged, router = picks(kind, temperature, "confidence-routed", bench), "confidence-routed"
            if judged.empty:
                continue
            share = float((judged == head).mean())
            interval = share_above(list(judged == head))
            intervals.append(interval)
            labels.append(f"{_b(bench)} share to {head} − 50%")
            text = (f"{_b(bench)} {share:.0%} of {len(judged)} questions to {head} ({router}) "
                    f"{_mark(interval, share > 0.5)} ({interval.text().replace('Δ', 'share − 50%')})")
            live = picks(kind, temperature, "confidence-routed", bench)
            if router == PER_QUESTION and not live.empty:
                text += f"; confidence-routed: {float((live == head).mean()):.0%} of questions by majority of steps"
            steps = step_share(kind, temperature, bench, head)
            if not math.isnan(steps):
                text += f", {steps:.0%} of steps to {head}"
            checks.append(text)
        if checks:
            finding.add(kind, temperature, "; ".join(checks), intervals, labels)
    return finding.decide("no routed GSM8K or MT-Bench questions")


def _gain_terms(kind: str, math_head: str, chat_head: str, weight: float) -> dict[str, list[Term]]:
    """Specialisation gain of one kind per benchmark: in-domain head's τ − the other head's (math head on the math
    benchmarks, chat head on MT-Bench), times `weight`."""
    return {bench: [(kind, math_head, weight), (kind, chat_head, -weight)] if bench in MATH_BENCHES
            else [(kind, chat_head, weight), (kind, math_head, -weight)] for bench in (*MATH_BENCHES, "mt_bench")}


def specialisation_by_kind(data: ReportData) -> Finding:
    finding = Finding("g", "Specialisation helps EAGLE-3 heads at least as much as EAGLE-2 and HASS heads (ours: "
                      "the gain is the in-domain head's τ minus the other head's, averaged over the benchmarks; "
                      "Δ = EAGLE-3's gain − the other kind's)", "not studied in TAPS, which has no EAGLE-3 heads")
    math_head, chat_head = data.specialist("mathinstruct"), data.specialist("sharegpt")
    if not (math_head and chat_head) or "eagle3" not in data.kinds:
        return finding.decide("needs eagle3 heads beside another kind, each with math and chat specialists")
    for temperature in data.temperatures:
        for other in (k for k in data.kinds if k != "eagle3"):
            terms = _common(data, temperature, {b: t + _gain_terms(other, math_head, chat_head, -1.0)[b]
                                                for b, t in _gain_terms("eagle3", math_head, chat_head, 1.0).items()})
            if not terms:
                continue
            gains = {k: tau_contrast(data.questions, temperature, {b: _gain_terms(k, math_head, chat_head, 1.0)[b]
                                                                   for b in terms}) for k in ("eagle3", other)}
            interval = tau_contrast(data.questions, temperature, terms)
            if interval is None or None in gains.values():
                continue
            shown = [f"{KIND_LABELS.get(k, k)} {g.delta:+.2f} ({CONFIDENCE:.0%} CI [{g.low:+.2f}, {g.high:+.2f}])"
                     for k, g in gains.items()]
            text = f"gain over {', '.join(map(_b, terms))}: {', '.join(shown)}; difference {interval.text()}"
            finding.add(f"EAGLE-3 vs {KIND_LABELS.get(other, other)}", temperature, text, [interval])
    return finding.decide("eagle3 and another kind's math and chat heads not evaluated on a common benchmark")


def _common(data: ReportData, temperature: float, terms: dict[str, list[Term]]) -> dict[str, list[Term]]:
    """The benchmarks where every term's cell was measured at `temperature`."""
    return {b: t for b, t in terms.items()
            if all(not math.isnan(data.value(kind, p, b, temperature)) for kind, p, _ in t)}


LEARNED, ROUTED, MERGED = "learned-routed", "confidence-routed", "merged"


def learned_routing(data: ReportData) -> Finding:
    """(h), ours: the router that learns from merged steps' acceptance against confidence routing (per benchmark)
    and merged trees (average, within `NEAR_BEST`), with its drafting cost (the share of merged steps)."""
    finding = Finding("h", f"The learned router is at least as good as confidence routing on every benchmark and "
                      f"within {NEAR_BEST:.0%} of merged trees (average τ), at a lower drafting cost (ours)",
                      "not in TAPS (a Hedge router over verification's acceptance, docs/algorithms.md#learned-routing)")
    for kind, temperature in _settings(data):
        if not (_measured(data, kind, temperature, LEARNED) and _measured(data, kind, temperature, ROUTED)):
            continue
        checks, intervals, labels = [], [], []
        for bench in data.benchmarks:
            learned, routed = (data.value(kind, p, bench, temperature) for p in (LEARNED, ROUTED))
            if math.isnan(learned) or math.isnan(routed):
                continue
            interval = _difference(data, kind, temperature, LEARNED, ROUTED, [bench])
            intervals.append(interval)
            labels.append(f"{_b(bench)} vs {ROUTED}")
            checks.append(f"{_b(bench)} {learned:.2f} vs {routed:.2f} {_mark(interval, learned >= routed)}"
                          f"{_noise(interval)}")
        benches, averages = _common_average(data, kind, temperature, [LEARNED, MERGED])
        if benches:
            ok = averages[LEARNED] >= averages[MERGED] * (1 - NEAR_BEST)
            interval = _difference(data, kind, temperature, LEARNED, MERGED, benches, scale=1 - NEAR_BEST)
            intervals.append(interval)
            labels.append(f"vs {1 - NEAR_BEST:g} × {MERGED}")
            checks.append(f"average {averages[LEARNED]:.2f} vs merged {averages[MERGED]:.2f}: {LEARNED} − "
                          f"{1 - NEAR_BEST:g} × {MERGED} {_mark(interval, ok)}{_noise(interval)}")
        checks.append(_merged_share(data, kind, temperature))
        finding.add(kind, temperature, "; ".join(checks), intervals, labels)
    return finding.decide(f"{LEARNED} and {ROUTED} not evaluated together")


def _merged_share(data: ReportData, kind: str, temperature: float) -> str:
    """The learned router's drafting cost: the share of its steps that were merged (both heads drafted, both trees
    verified); the rest drafted with one head, where confidence routing drafts with two every step."""
    r = data.routing
    rows = r[(r["head_kind"] == kind) & (r["proposer"] == LEARNED) & (r["temperature"] == temperature)
             & (r["unit"] == "steps")] if len(r) else r
    merged = rows[rows["head"] == "merged"]["fraction"]
    if not len(merged):
        return "drafting cost: no per-step records"
    share = float(merged.mean())
    return f"drafting cost: {share:.0%} merged steps, {1 + share:.2f} heads drafted per step (confidence routing 2)"


CLAIMS: list[Callable[[ReportData], Finding]] = [
    specialisation, robustness, beats_averaging, confidence_vs_entropy, entropy_gap, routing, specialisation_by_kind,
    learned_routing,
]


def findings(data: ReportData) -> list[Finding]:
    return [claim(data) for claim in CLAIMS]


def summary_md(results: list[Finding]) -> str:
    """One line per claim: its verdict and the check that decides it (the full evidence is under Findings)."""
    return "\n".join(f.summary_line() for f in results)


def findings_md(data: ReportData, results: list[Finding] | None = None) -> str:
    results = results if results is not None else findings(data)
    summary = data.summary
    scale = ""
    if not summary.empty:
        low, high = summary["n_questions"].min(), summary["n_questions"].max()
        scale = (f" Each cell holds {low if low == high else f'{low}–{high}'} questions. Every check carries Δ "
                 f"(oriented so that Δ > 0 favours the claim) and its {CONFIDENCE:.0%} interval from a bootstrap over "
                 "questions (resampled within each benchmark; paired: the same resample for both proposers, or for "
                 "accepted and rejected nodes); an interval that straddles zero means the difference is within the "
                 "noise of this many questions.")
    intro = ("Each TAPS claim checked against the tables above, separately per head kind × temperature, and decided "
             "by its intervals: a setting HOLDS when every interval lies above zero, DOES NOT HOLD when one lies "
             "below, and is WITHIN NOISE otherwise; the claim HOLDS when every measured setting holds, MOSTLY HOLDS "
             "when none fails and more than half hold. Each check is marked by its interval: ✓ above zero (for the "
             "claim), ✗ below, ≈ within noise." + scale)
    return intro + "\n\n" + "\n".join(f.markdown() for f in results)
