"""Per-cell summaries from the results store: tau (both definitions), speed, and agreement with greedy."""

from __future__ import annotations

import pandas as pd

from taps_ray.eval.cell import PLAIN

CELL_KEYS = ["head_kind", "proposer", "benchmark", "temperature"]


def summarize(questions: pd.DataFrame) -> pd.DataFrame:
    """One row per cell. tau = Σ new tokens / Σ steps (Spec-Bench), tau_taps = Σ committed / Σ (steps−1), the sum
    over turns as TAPS takes it (a one-step turn adds its tokens and no step; nan when no turn took two steps)."""
    if questions.empty:
        return pd.DataFrame(columns=[*CELL_KEYS, "tau", "tau_taps", "steps", "n_questions", "tokens_per_s", "speedup"])
    grouped = questions.groupby(CELL_KEYS, sort=True)
    summary = grouped.agg(
        new_tokens=("new_tokens", "sum"),
        n_tokens=("n_tokens", "sum"),
        committed=("committed", "sum"),
        steps=("steps", "sum"),
        taps_steps=("taps_steps", "sum"),
        wall_s=("wall_s", lambda wall: wall.sum(min_count=1)),  # NaN for replayed cells, which have no speed
        n_questions=("question_id", "nunique"),
        n_turns=("turn", "size"),
    ).reset_index()
    summary["tau"] = summary["new_tokens"] / summary["steps"].clip(lower=1)
    summary["tau_taps"] = summary["committed"] / summary["taps_steps"].where(summary["taps_steps"] > 0)
    summary["tokens_per_s"] = summary["n_tokens"] / summary["wall_s"].where(summary["wall_s"] > 0)
    plain = summary[summary["proposer"] == PLAIN][["benchmark", "temperature", "tokens_per_s"]]
    plain = plain.groupby(["benchmark", "temperature"], as_index=False)["tokens_per_s"].mean()
    summary = summary.merge(plain, on=["benchmark", "temperature"], how="left", suffixes=("", "_plain"))
    summary["speedup"] = summary["tokens_per_s"] / summary["tokens_per_s_plain"]
    summary["greedy_match"] = _greedy_match(questions, summary)
    return summary.drop(columns=["tokens_per_s_plain"])


def _greedy_match(questions: pd.DataFrame, summary: pd.DataFrame) -> list[float | None]:
    """At T=0, the fraction of answers identical to plain greedy decoding of the same prompt, over the answers that
    plain decoding has (a replayed cell holds whole benchmarks, plain decoding its first questions only)."""
    plain = questions[(questions["proposer"] == PLAIN) & (questions["temperature"] == 0)]
    reference = {(r.benchmark, r.question_id, r.turn): tuple(r.tokens) for r in plain.itertuples()}
    rates: list[float | None] = []
    for row in summary.itertuples():
        if row.temperature != 0 or not reference:
            rates.append(None)
            continue
        cell = questions[
            (questions["head_kind"] == row.head_kind)
            & (questions["proposer"] == row.proposer)
            & (questions["benchmark"] == row.benchmark)
            & (questions["temperature"] == 0)
        ]
        keys = [((r.benchmark, r.question_id, r.turn), tuple(r.tokens)) for r in cell.itertuples()]
        same = [reference[key] == tokens for key, tokens in keys if key in reference]
        rates.append(sum(same) / len(same) if same else None)
    return rates
