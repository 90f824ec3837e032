"""Paired bootstrap intervals over questions, one per claim check (docs/algorithms.md#what-the-reports-count).

Every proposer decodes the same questions, so most of the spread between questions (easy vs hard prompts) is shared.
Resampling questions with replacement, within each benchmark, and recomputing both pooled τs on the same resample
gives the noise of the *difference*, which is what a claim like "the math head beats the chat head" rests on. The
entropy gap (accepted and rejected nodes of the same questions) and routing shares are resampled the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

CONFIDENCE = 0.95
RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """τ(a) − τ(b) with a percentile bootstrap interval at CONFIDENCE."""

    delta: float
    low: float
    high: float

    @property
    def sign(self) -> int:
        """+1 when the whole interval is above zero, −1 when below, 0 when it straddles zero (within noise)."""
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def flipped(self) -> "Interval":
        return Interval(-self.delta, -self.high, -self.low)

    def text(self) -> str:
        return f"Δ {self.delta:+.2f}, {CONFIDENCE:.0%} CI [{self.low:+.2f}, {self.high:+.2f}]"


def _per_question(questions: pd.DataFrame, proposer: str) -> pd.DataFrame:
    """New tokens and verification steps per question, summed over its turns."""
    rows = questions[questions["proposer"] == proposer]
    return rows.groupby("question_id")[["new_tokens", "steps"]].sum()


def _pooled_tau(sums: np.ndarray) -> np.ndarray:
    """Σ new tokens / Σ steps from [..., 2] column sums (new tokens, steps)."""
    return sums[..., 0] / np.maximum(sums[..., 1], 1)


def _percentile_interval(draws: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.nanpercentile(draws, [tail, 100 - tail])  # nan: a resample with an empty group (entropy gap)
    return float(low), float(high)


def tau_interval(questions: pd.DataFrame, kind: str, temperature: float, proposer: str, benchmark: str,
                 resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of one cell's pooled τ over its questions; None when the cell is empty."""
    rows = questions[(questions["head_kind"] == kind) & (questions["temperature"] == temperature)
                     & (questions["benchmark"] == benchmark)]
    values = _per_question(rows, proposer).to_numpy(dtype=float)
    if not len(values):
        return None
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    return _percentile_interval(_pooled_tau(values[picks].sum(axis=1)))


def tau_difference(questions: pd.DataFrame, kind: str, temperature: float, a: str, b: str, benchmarks: list[str],
                   resamples: int = RESAMPLES, seed: int = 0, scale: float = 1.0) -> Interval | None:
    """Mean over `benchmarks` of pooled τ(a) − scale·τ(b), on the questions both proposers answered; None when none.

    Pooled τ = Σ new tokens / Σ steps, the definition of the report's tables, so `delta` equals the difference of
    the tables' averages whenever both proposers answered the same questions. `scale` < 1 tests "a is within
    1 − scale of b".
    """
    setting = questions[questions["head_kind"] == kind]
    terms = {bench: [(kind, a, 1.0), (kind, b, -scale)] for bench in benchmarks}
    return tau_contrast(setting, temperature, terms, resamples, seed)


def _stratified(values: np.ndarray, strata: np.ndarray, statistic, resamples: int, seed: int) -> Interval | None:
    """`statistic` of the column sums of `values` [questions, c] and its percentile bootstrap interval, questions
    resampled with replacement within each stratum (benchmark); None when there are no questions."""
    if not len(values):
        return None
    rng = np.random.default_rng(seed)
    sums = np.zeros((resamples, values.shape[1]))
    for stratum in np.unique(strata):
        rows = values[strata == stratum]
        sums += rows[rng.integers(0, len(rows), size=(resamples, len(rows)))].sum(axis=1)
    return Interval(float(statistic(values.sum(axis=0))), *_percentile_interval(statistic(sums)))


def entropy_gap(sums: pd.DataFrame, resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """Pooled mean entropy of rejected minus accepted drafted nodes over one cell group's per-question node sums
    (report.data.node_entropy_sums), with its interval over questions; None when either group is empty."""
    values = sums[["entropy_accepted_sum", "n_accepted", "entropy_rejected_sum", "n_rejected"]].to_numpy(float)
    if not len(values) or values[:, 1].sum() == 0 or values[:, 3].sum() == 0:
        return None

    def gap(totals: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return totals[..., 2] / totals[..., 3] - totals[..., 0] / totals[..., 1]

    return _stratified(values, sums["benchmark"].to_numpy(), gap, resamples, seed)


def share_above(picks: list[bool], threshold: float = 0.5, resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """Share of questions where `picks` is true, minus `threshold`, with its interval over questions."""
    values = np.array(picks, dtype=float).reshape(-1, 1)
    return _stratified(np.hstack([values, np.ones_like(values)]), np.zeros(len(values)),
                       lambda sums: sums[..., 0] / np.maximum(sums[..., 1], 1) - threshold, resamples, seed)


def pooled_mean(sums: list[float], counts: list[int], resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """Σ sums / Σ counts over questions (a mean over all their positions, `sums[i]` over `counts[i]` of question
    i's) with its interval over questions; None when there are none."""
    values = np.column_stack([np.asarray(sums, dtype=float), np.asarray(counts, dtype=float)])
    return _stratified(values, np.zeros(len(values)), lambda s: s[..., 0] / np.maximum(s[..., 1], 1), resamples, seed)


Term = tuple[str, str, float]  # (head kind, proposer, weight)


def tau_contrast(questions: pd.DataFrame, temperature: float, terms: dict[str, list[Term]],
                 resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """Mean over benchmarks of Σ weight · pooled τ(kind, proposer), with `terms` per benchmark, on the questions
    every term answered; questions resampled within each benchmark, the same resample for every term (paired
    across proposers and head kinds). None when a benchmark has no common question."""
    setting = questions[questions["temperature"] == temperature]
    rng = np.random.default_rng(seed)
    deltas, draws = [], []
    for bench, bench_terms in terms.items():
        rows = setting[setting["benchmark"] == bench]
        frames = [_per_question(rows[rows["head_kind"] == kind], proposer).add_suffix(f"_{i}")
                  for i, (kind, proposer, _) in enumerate(bench_terms)]
        paired = frames[0].join(frames[1:], how="inner") if len(frames) > 1 else frames[0]
        if paired.empty:
            return None
        values = paired.to_numpy(dtype=float)  # columns: new_0, steps_0, new_1, steps_1, ...
        weights = np.array([w for *_, w in bench_terms])

        def contrast(sums: np.ndarray) -> np.ndarray:
            taus = np.stack([_pooled_tau(sums[..., 2 * i: 2 * i + 2]) for i in range(len(bench_terms))], axis=-1)
            return taus @ weights

        deltas.append(float(contrast(values.sum(axis=0))))
        draws.append(contrast(values[rng.integers(0, len(values), size=(resamples, len(values)))].sum(axis=1)))
    if not deltas:
        return None
    return Interval(float(np.mean(deltas)), *_percentile_interval(np.mean(draws, axis=0)))

