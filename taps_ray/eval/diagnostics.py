"""Entropy / confidence diagnostics over per-step decoding records (docs/algorithms.md#diagnostics), pure functions.

Inputs are `StepRecord`s (taps_ray.decoding.generate): per drafted node of each verified tree, its cumulative
confidence, the entropy of the distribution it was drawn from, whether the target accepted it and which
head drafted it; per step, which head's tree was verified (-1 for a merged tree).

EAGLE-side definition: accepted nodes are the drafted nodes on the accepted path; **every other drafted
node is rejected**, including nodes the verifier never tested (docs/algorithms.md#diagnostics).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from taps_ray.decoding.step import head_counts


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def accepted_vs_rejected(records: Iterable[Any], source: int | None = None) -> dict[str, float]:
    """Mean entropy and confidence of accepted vs rejected drafted nodes, pooled over all steps.

    `source` restricts to nodes drafted by one head (merged trees). Returns the means, node counts,
    delta_entropy = rejected − accepted and delta_confidence = accepted − rejected (nan when a group is empty).
    """
    groups: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for record in records:
        nodes = zip(record.node_confidence, record.node_entropy, record.node_accepted, record.node_source)
        for conf, ent, acc, src in nodes:
            if source is not None and src != source:
                continue
            groups[bool(acc)][0].append(conf)
            groups[bool(acc)][1].append(ent)
    (acc_conf, acc_ent), (rej_conf, rej_ent) = groups[True], groups[False]
    out = {
        "n_accepted": float(len(acc_conf)),
        "n_rejected": float(len(rej_conf)),
        "entropy_accepted": _mean(acc_ent),
        "entropy_rejected": _mean(rej_ent),
        "confidence_accepted": _mean(acc_conf),
        "confidence_rejected": _mean(rej_conf),
    }
    out["delta_entropy"] = out["entropy_rejected"] - out["entropy_accepted"]
    out["delta_confidence"] = out["confidence_accepted"] - out["confidence_rejected"]
    return out


def routing_fractions(records: Iterable[Any], head_names: Sequence[str] | None = None) -> dict[Any, float]:
    """Fraction of verification steps that used each head's tree, keyed as in `head_counts`."""
    counts = head_counts(records, head_names)
    total = sum(counts.values())
    return {key: n / total for key, n in counts.items()} if total else {}


def mean_node_confidence(records: Iterable[Any]) -> float:
    """Mean confidence over every drafted node of every step (TAPS's per-question routing score); nan if none."""
    return _mean([c for record in records for c in record.node_confidence])


def majority_head(records: Iterable[Any]) -> int | None:
    """The head whose tree was verified in most of the drafted steps (ties to the lower index); None if none.

    A question's unit for a per-step router: its steps may switch heads, the question goes to the majority.
    """
    counts = Counter(r.head for r in records if r.head >= 0)
    return min(counts, key=lambda h: (-counts[h], h)) if counts else None


def signal_agreement(
    confidence: Mapping[str, Sequence[float]],
    entropy: Mapping[str, Sequence[float]],
    tau_by_head: Mapping[str, Sequence[float]],
    tol: float = 1e-9,
) -> dict[str, Any]:
    """How well each routing signal picks the better head, per question.

    Each mapping is head name -> one value per question (aligned lists): the question's mean node confidence,
    mean node entropy and τ under that head. Per question the confidence signal picks argmax confidence and the
    entropy signal argmin entropy (ties to the earlier head); a pick is correct when its τ is within `tol` of
    the best head's τ (so questions where the heads tie count as correct for any pick).

    Returns per signal the accuracy and the mean τ obtained by following it, together with the oracle
    (per-question best) τ, each head's mean τ, the number of questions and of decisive ones (a unique best head).
    """
    heads = list(tau_by_head)
    if not heads:
        raise ValueError("signal_agreement needs at least one head")
    for name, table in (("confidence", confidence), ("entropy", entropy)):
        if set(table) != set(heads):
            raise ValueError(f"{name} heads {sorted(table)} differ from tau heads {sorted(heads)}")
    n = len(tau_by_head[heads[0]])
    for table in (confidence, entropy, tau_by_head):
        for head in heads:
            if len(table[head]) != n:
                raise ValueError(f"head {head!r} has {len(table[head])} questions, expected {n}")

    correct = {"confidence": 0, "entropy": 0}
    routed = {"confidence": 0.0, "entropy": 0.0}
    oracle = 0.0
    decisive = 0
    for q in range(n):
        taus = [tau_by_head[h][q] for h in heads]
        best = max(taus)
        if sum(t >= best - tol for t in taus) == 1:
            decisive += 1
        picks = {
            "confidence": min(range(len(heads)), key=lambda i: (-confidence[heads[i]][q], i)),
            "entropy": min(range(len(heads)), key=lambda i: (entropy[heads[i]][q], i)),
        }
        for signal, pick in picks.items():
            correct[signal] += taus[pick] >= best - tol
            routed[signal] += taus[pick]
        oracle += best
    return {
        "questions": n,
        "decisive": decisive,
        "confidence_accuracy": correct["confidence"] / n if n else math.nan,
        "entropy_accuracy": correct["entropy"] / n if n else math.nan,
        "confidence_routed_tau": routed["confidence"] / n if n else math.nan,
        "entropy_routed_tau": routed["entropy"] / n if n else math.nan,
        "oracle_tau": oracle / n if n else math.nan,
        "head_tau": {h: _mean(list(tau_by_head[h])) for h in heads},
    }


# --- post-hoc per-question router (docs/algorithms.md#per-question-confidence-router) -----------------------


def per_question_confidence_choice(
    records_by_head: dict[str, list[Any]], eps: float = 0.01, fallback: str | None = "mixed"
) -> str:
    """The head a per-question confidence router picks from complete single-head generations of one question.

    records_by_head: head name -> that head's `StepRecord`s for the question (all turns). A head's score is
    the mean confidence over every drafted node of every step. The fallback head (if present in the dict) is
    not a candidate; when the two best candidates' scores differ by less than `eps`, the fallback is chosen
    (the reference chooses Mixed), or the first candidate when `fallback` is None. Otherwise the highest score
    wins, ties to the earlier head. An analysis tool: it needs every head's full generation (oracle-like).
    """
    candidates = [name for name in records_by_head if name != fallback]
    if not candidates:
        raise ValueError(f"no candidate heads besides the fallback {fallback!r}")
    scores = {}
    for name in candidates:
        score = mean_node_confidence(records_by_head[name])
        scores[name] = 0.0 if math.isnan(score) else score
    ranked = sorted(candidates, key=lambda n: (-scores[n], candidates.index(n)))
    if len(ranked) >= 2 and abs(scores[ranked[0]] - scores[ranked[1]]) < eps:
        return fallback if fallback is not None else candidates[0]
    return ranked[0]
