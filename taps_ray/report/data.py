"""Everything the report shows, derived from the results store alone (no model, no torch).

`load_report_data` reads the store and computes the per-cell summary (taps_ray.eval.metrics), the
accepted-vs-rejected entropy of drafted nodes and the routing fractions (taps_ray.eval.diagnostics).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from taps_ray.config import BENCHMARKS, HEAD_KINDS, StudyConfig
from taps_ray.eval.diagnostics import majority_head, mean_node_confidence, routing_fractions
from taps_ray.drafting.names import averaged_weight, entropy_candidates
from taps_ray.eval.cell import PLAIN
from taps_ray.eval.metrics import summarize
from taps_ray.eval.store import ResultsStore
from taps_ray.workdir import results_dir

BENCH_LABELS = {"mt_bench": "MT-Bench", "gsm8k": "GSM8K", "math_500": "MATH-500", "svamp": "SVAMP"}
KIND_LABELS = {"eagle2": "EAGLE-2", "hass": "HASS", "eagle3": "EAGLE-3", "none": "none"}
OURS = ("merged-dedup", "merged-budget", "learned-routed")
PER_QUESTION = "per-question confidence"  # TAPS's routing table: each question to the head of higher mean confidence
COMBINED = ("averaged", "confidence-routed", "entropy-routed", "merged", *OURS)
CELLS_FILE = "cells.json"  # in a report's results/ copy: done.json of every cell and the failures
CONFIG_FILE = "config.yaml"  # in a report's results/ copy: the study config the report was built with
DERIVED_FILES = {"node_sums": "node_entropy_sums.parquet", "question_routing": "question_routing.parquet",
                 "routing": "routing.parquet"}  # in a report's results/ copy: what the report reads of the steps


@dataclass
class ReportData:
    config: StudyConfig
    summary: pd.DataFrame  # one row per cell (metrics.summarize)
    entropy: pd.DataFrame  # head_kind, proposer, temperature, entropy_accepted/rejected, delta_entropy, n_*
    routing: pd.DataFrame  # head_kind, proposer, benchmark, temperature, head, fraction, unit
    question_routing: pd.DataFrame = field(default_factory=pd.DataFrame)  # `question_routing`: one row per question
    node_sums: pd.DataFrame = field(default_factory=pd.DataFrame)  # `node_entropy_sums`: one row per drafted question
    failures: list[dict] = field(default_factory=list)
    meta: list[dict] = field(default_factory=list)  # done.json of every finished cell
    questions: pd.DataFrame = field(default_factory=pd.DataFrame)
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    store_root: Path | None = None
    from_copy: bool = False  # store_root is a report's results/ copy, not a results store
    step_tables: bool = True  # False: a copy that holds neither the steps nor the tables derived from them

    def unmeasured(self, reason: str) -> str:
        """Why something read from the per-step records is missing: `reason`, or that this copy does not hold them."""
        if self.step_tables:
            return reason
        return ("this results copy predates the tables a copy now keeps of the per-step records, and holds no steps "
                "(too big to copy, see results/STEPS_NOT_COPIED.txt); rebuild the report from the results store")

    @property
    def head_names(self) -> list[str]:
        """Index of `StepRecord.head` -> head (mixture) name: heads are loaded in `train.mixtures` order."""
        return list(self.config.train.mixtures)

    def specialist(self, corpus: str) -> str | None:
        """The single head trained only on `corpus` (math: mathinstruct, chat: sharegpt)."""
        for name in self.config.train.mixtures:
            if set(self.config.mixtures[name].mixture) == {corpus}:
                return name
        return None

    @property
    def mixture_heads(self) -> list[str]:
        """Heads trained on more than one corpus."""
        return [n for n, m in self.config.mixtures.items() if len(m.mixture) > 1]

    @property
    def single_heads(self) -> list[str]:
        return list(dict.fromkeys([*self.config.train.mixtures, *self.config.mixtures]))

    @property
    def kinds(self) -> list[str]:
        present = set(self.summary["head_kind"]) - {"none"} if not self.summary.empty else set()
        return [k for k in HEAD_KINDS if k in present] + sorted(present - set(HEAD_KINDS))

    @property
    def temperatures(self) -> list[float]:
        return sorted(set(self.summary["temperature"])) if not self.summary.empty else []

    @property
    def benchmarks(self) -> list[str]:
        """The four TAPS benchmarks in paper order, then any other measured ones."""
        present = set(self.summary["benchmark"]) if not self.summary.empty else set()
        return list(BENCHMARKS) + sorted(present - set(BENCHMARKS))

    @functools.cached_property
    def _cells(self) -> dict[tuple, dict]:
        return {(r["head_kind"], r["proposer"], r["benchmark"], float(r["temperature"])): r
                for r in self.summary.to_dict("records")}

    def value(self, kind: str, proposer: str, benchmark: str, temperature: float, column: str = "tau") -> float:
        """One number of one cell (plain decoding is stored under head kind "none"); nan when missing."""
        row = self._cells.get(("none" if proposer == PLAIN else kind, proposer, benchmark, float(temperature)))
        value = row.get(column) if row else None
        return math.nan if value is None or pd.isna(value) else float(value)

    def sweep(self, kind: str) -> list[tuple[float, str]]:
        """(w, proposer) of the averaging sweep, when `averaged-w{w}` cells exist. The math head is w = 1 and the
        chat head w = 0 (averaged-w1 / -w0 share their weights), used as the end points unless measured as such."""
        cells = {averaged_weight(p): p for p in self.proposers(kind) if averaged_weight(p) is not None}
        if not any(p != "averaged" for p in cells.values()):
            return []
        for w, corpus in ((1.0, "mathinstruct"), (0.0, "sharegpt")):
            head = self.specialist(corpus)
            if w not in cells and head in self.proposers(kind):
                cells[w] = head
        return sorted(cells.items())

    def proposers(self, kind: str) -> list[str]:
        if self.summary.empty:
            return []
        return sorted(set(self.summary.loc[self.summary["head_kind"] == kind, "proposer"]))


@dataclass(frozen=True)
class ReportCopy:
    """The `results/` folder a report writes next to its README: rebuilds the report without the results store."""

    root: Path

    def _frame(self, name: str) -> pd.DataFrame:
        path = self.root / name
        return pd.read_parquet(path) if path.exists() else pd.DataFrame()

    @functools.cached_property
    def _cells(self) -> dict:
        path = self.root / CELLS_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def questions(self) -> pd.DataFrame:
        return self._frame("questions.parquet")

    def steps(self) -> pd.DataFrame:
        return self._frame("steps.parquet")

    def failures(self) -> list[dict]:
        return self._cells.get("failures", [])

    def meta(self) -> list[dict]:
        return self._cells.get("cells", [])

    def derived(self) -> dict[str, pd.DataFrame] | None:
        """The tables the report derives from the per-step records (`DERIVED_FILES`), or None in a copy that has
        not got them all (one written before copies carried them)."""
        if not all((self.root / name).is_file() for name in DERIVED_FILES.values()):
            return None
        return {key: self._frame(name) for key, name in DERIVED_FILES.items()}

    def config_path(self) -> Path | None:
        """The study config the report was built with, saved in the copy (None in a copy made before that)."""
        path = self.root / CONFIG_FILE
        return path if path.is_file() else None


def results_source(path: Path) -> ResultsStore | ReportCopy:
    """A results store (has `cells/`) or a report's `results/` copy (has questions.parquet); else a clear error."""
    path = Path(path).expanduser()
    if (path / "cells").is_dir():
        return ResultsStore(path)
    if (path / "questions.parquet").is_file():
        return ReportCopy(path)
    raise FileNotFoundError(f"{path} is neither a results store (no cells/ folder) nor a report's results/ copy "
                            "(no questions.parquet); run the evaluation first (`make sweep`) or pass the right folder")


def load_report_data(config: StudyConfig, store: ResultsStore | ReportCopy | None = None) -> ReportData:
    store = store or ResultsStore(results_dir(config))
    questions = store.questions()
    steps = store.steps()
    meta = store.meta()
    derived = store.derived() if isinstance(store, ReportCopy) else None
    step_tables = derived is not None or not (isinstance(store, ReportCopy) and steps.empty)
    if derived is None:  # from the steps: a results store, or a copy made before copies carried the derived tables
        per_question = question_routing(steps, list(config.train.mixtures))
        derived = {"node_sums": node_entropy_sums(steps), "question_routing": per_question,
                   "routing": routing_table(steps, list(config.train.mixtures), per_question)}
    return ReportData(
        config=config,
        summary=summarize(questions),
        entropy=entropy_table(derived["node_sums"]),
        node_sums=derived["node_sums"],
        routing=derived["routing"],
        question_routing=derived["question_routing"],
        failures=store.failures(),
        meta=meta,
        questions=questions,
        steps=steps,
        store_root=store.root,
        from_copy=isinstance(store, ReportCopy),
        step_tables=step_tables,
    )


NODE_SUM_KEYS = ["head_kind", "proposer", "temperature", "benchmark", "question_id"]
NODE_SUMS = ["entropy_accepted_sum", "n_accepted", "entropy_rejected_sum", "n_rejected"]


def node_entropy_sums(steps: pd.DataFrame) -> pd.DataFrame:
    """Per drafted question: Σ entropy and count of its accepted and of its rejected drafted nodes. The entropy table
    and finding (e)'s interval over questions need no more, so a report's results copy keeps this, not the steps."""
    if steps.empty or "node_entropy" not in steps:
        return pd.DataFrame(columns=NODE_SUM_KEYS + NODE_SUMS)
    sums: dict[tuple, list[float]] = {}
    for row in steps[steps["proposer"] != PLAIN].itertuples(index=False):
        key = tuple(getattr(row, k) for k in NODE_SUM_KEYS)
        totals = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        for entropy, accepted in zip(row.node_entropy, row.node_accepted):
            totals[0 if accepted else 2] += float(entropy)
            totals[1 if accepted else 3] += 1
    frame = pd.DataFrame([[*key, *totals] for key, totals in sums.items()], columns=NODE_SUM_KEYS + NODE_SUMS)
    return frame.sort_values(NODE_SUM_KEYS, ignore_index=True)


def entropy_table(sums: pd.DataFrame) -> pd.DataFrame:
    """Accepted vs rejected drafted-node entropy per head kind × proposer × temperature (pooled over benchmarks),
    from `node_entropy_sums`."""
    columns = ["head_kind", "proposer", "temperature", "entropy_accepted", "entropy_rejected", "delta_entropy",
               "n_accepted", "n_rejected"]
    rows = []
    for (kind, proposer, temperature), group in sums.groupby(["head_kind", "proposer", "temperature"], sort=True):
        total = group[NODE_SUMS].sum()
        if total["n_accepted"] + total["n_rejected"] == 0:
            continue
        accepted = total["entropy_accepted_sum"] / total["n_accepted"] if total["n_accepted"] else math.nan
        rejected = total["entropy_rejected_sum"] / total["n_rejected"] if total["n_rejected"] else math.nan
        rows.append([kind, proposer, temperature, accepted, rejected, rejected - accepted,
                     float(total["n_accepted"]), float(total["n_rejected"])])
    return pd.DataFrame(rows, columns=columns)


def question_routing(steps: pd.DataFrame, head_names: list[str]) -> pd.DataFrame:
    """Which head each question (all its turns) went to, per router (docs/algorithms.md#what-the-reports-count).

    `per-question confidence` (TAPS's unit for its routing shares): heads A and B each decode the question alone;
    it goes to the one whose drafted nodes have the higher mean confidence (ties to A). `confidence-routed`: the
    head that drafted the majority of the question's steps under the per-step router (ties to the lower index).
    """
    columns = ["head_kind", "temperature", "benchmark", "router", "question_id", "head"]
    if steps.empty or len(head_names) < 2:
        return pd.DataFrame(columns=columns)
    rows = []
    keys = ["head_kind", "temperature", "benchmark"]
    pair = steps[steps["proposer"].isin(head_names[:2])]
    for (kind, temperature, bench), group in pair.groupby(keys, sort=True):
        scores = {h: {q: mean_node_confidence(g.itertuples(index=False)) for q, g in part.groupby("question_id")}
                  for h, part in group.groupby("proposer")}
        if len(scores) < 2:
            continue
        a, b = (scores[h] for h in head_names[:2])
        for q in sorted(set(a) & set(b)):
            head = head_names[0] if not a[q] < b[q] else head_names[1]
            rows.append([kind, temperature, bench, PER_QUESTION, q, head])
    routed = steps[steps["proposer"] == "confidence-routed"]
    for (kind, temperature, bench, q), group in routed.groupby([*keys, "question_id"], sort=True):
        head = majority_head(group.itertuples(index=False))
        if head is not None:
            rows.append([kind, temperature, bench, "confidence-routed", q,
                         head_names[head] if head < len(head_names) else str(head)])
    return pd.DataFrame(rows, columns=columns)


def routing_table(steps: pd.DataFrame, head_names: list[str], per_question: pd.DataFrame) -> pd.DataFrame:
    """Which head drafted: per question (`question_routing`), confidence-routed and learned-routed also per
    verification step ("merged" for the learned router's merged steps), entropy-routed per sequence (question ×
    turn)."""
    columns = ["head_kind", "proposer", "benchmark", "temperature", "head", "fraction", "unit"]
    if steps.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for (kind, router, bench, temperature), group in per_question.groupby(
        ["head_kind", "router", "benchmark", "temperature"], sort=True
    ):
        for head, fraction in group["head"].value_counts(normalize=True).sort_index().items():
            rows.append({"head_kind": kind, "proposer": router, "benchmark": bench, "temperature": temperature,
                         "head": head, "fraction": float(fraction), "unit": "questions"})
    routed = steps[steps["proposer"].isin(["confidence-routed", "entropy-routed", "learned-routed"])]
    for (kind, proposer, bench, temperature), group in routed.groupby(
        ["head_kind", "proposer", "benchmark", "temperature"], sort=True
    ):
        if proposer == "entropy-routed":  # the head chosen by the first step drafts the whole sequence
            group = group.sort_values("step").groupby(["question_id", "turn"], sort=False).head(1)
            unit = "question turns"
        else:
            unit = "steps"
        parts = entropy_candidates(head_names) if proposer == "entropy-routed" else head_names
        names = parts if max(group["head"], default=0) < len(parts) else None
        for head, fraction in routing_fractions(group.itertuples(index=False), names).items():
            rows.append({"head_kind": kind, "proposer": proposer, "benchmark": bench, "temperature": temperature,
                         "head": str(head), "fraction": fraction, "unit": unit})
    return pd.DataFrame(rows, columns=columns)
