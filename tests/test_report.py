"""The report from a synthetic results store: tables, summary.json, plots, findings, failures, missing cells."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from taps_ray.config import parse_config
from taps_ray.eval.metrics import summarize
from taps_ray.eval.cell import Cell
from taps_ray.eval.store import ResultsStore
from taps_ray.report import build, build_report
from taps_ray.report.data import ReportCopy, load_report_data, results_source
from taps_ray.report.setting import setting_md
from taps_ray.report import plots
from taps_ray.report.findings import FAILS, HOLDS, MOSTLY, NOISE, UNMEASURED, Finding, findings
from taps_ray.report.uncertainty import Interval, tau_difference, tau_interval
from taps_ray.workdir import results_dir

ACC_ENTROPY, REJ_ENTROPY = 0.5, 2.0  # nats; every synthetic step has this gap, so Δ = 1.5


def _config(tmp_path):
    return parse_config({
        "name": "synthetic",
        "mixtures": {
            "math": {"mixture": {"mathinstruct": 1.0}, "size": 8},
            "chat": {"mixture": {"sharegpt": 1.0}, "size": 8},
            "mixed": {"mixture": {"mathinstruct": 0.5, "sharegpt": 0.5}, "size": 8},
        },
        "train": {"kinds": ["eagle2"], "mixtures": ["math", "chat", "mixed"]},
        "eval": {"benchmarks": {"mt_bench": 2, "gsm8k": 2}, "temperatures": [0.0]},
        "work_dir": str(tmp_path / "work"),
        "reports_dir": str(tmp_path / "reports"),
    })


def _write(store: ResultsStore, kind: str, proposer: str, bench: str, accepts: list[list[int]],
           heads: list[list[int]] | None = None, wall_per_token: float = 0.01) -> None:
    """One cell: `accepts[q]` = accepted drafts per step of question q; `heads[q]` = head index per step."""
    cell = Cell(kind, proposer, bench, 0.0)
    steps, questions = [], []
    for q, per_step in enumerate(accepts):
        base = {**cell.as_dict(), "question_id": str(q), "turn": 0}
        drafted = proposer != "plain"
        for i, a in enumerate(per_step):
            n_nodes = 4 if drafted else 0
            steps.append({
                **base, "step": i, "accepted": a, "new_tokens": a + 1, "tree_size": n_nodes + 1,
                "draft_s": 0.001, "verify_s": 0.001, "head": heads[q][i] if heads else (-1 if "merged" in proposer else 0),
                "node_confidence": [0.9 if j < a else 0.1 for j in range(n_nodes)],
                "node_entropy": [ACC_ENTROPY if j < a else REJ_ENTROPY for j in range(n_nodes)],
                "node_accepted": [j < a for j in range(n_nodes)],
                "node_source": [0] * n_nodes,
            })
        n = sum(a + 1 for a in per_step)
        questions.append({
            **base, "prompt_tokens": 10, "tokens": list(range(n)), "n_tokens": n, "new_tokens": n, "committed": n,
            "steps": len(per_step), "taps_steps": len(per_step) - 1, "tau": n / len(per_step),
            "wall_s": n * wall_per_token, "finished_by": "max_new_tokens",
        })
    store.write_cell(cell, steps, questions)


def _tau(accepts: list[list[int]]) -> float:
    return sum(a + 1 for q in accepts for a in q) / sum(len(q) for q in accepts)


GOOD, BAD = [[3, 3, 2], [3, 1]], [[0, 1, 0], [1, 0]]  # tau 3.40 and 1.40
MIXED = [[3, 3], [3]]  # tau 4.00: the best single head on GSM8K


def _store(tmp_path, specialised: bool = True) -> tuple:
    config = _config(tmp_path)
    store = ResultsStore(results_dir(config))
    math_gsm, chat_gsm = (GOOD, BAD) if specialised else (BAD, GOOD)
    math_mt, chat_mt = (BAD, GOOD) if specialised else (GOOD, BAD)
    for bench in ("gsm8k", "mt_bench"):
        _write(store, "none", "plain", bench, [[0] * 8, [0] * 6], wall_per_token=0.02)
    _write(store, "eagle2", "math", "gsm8k", math_gsm)
    _write(store, "eagle2", "chat", "gsm8k", chat_gsm)
    _write(store, "eagle2", "math", "mt_bench", math_mt)
    _write(store, "eagle2", "chat", "mt_bench", chat_mt)
    _write(store, "eagle2", "mixed", "gsm8k", MIXED)  # MT-Bench missing: shown as "–"
    _write(store, "eagle2", "averaged", "gsm8k", [[0, 0], [1]])
    _write(store, "eagle2", "averaged", "mt_bench", [[0, 0], [0]])
    _write(store, "eagle2", "averaged-w0.25", "gsm8k", [[1, 1], [1]])
    _write(store, "eagle2", "merged", "gsm8k", [[3, 3], [3]])
    _write(store, "eagle2", "merged", "mt_bench", [[2, 2], [2]])
    # confidence routing: GSM8K 3 of 4 steps by the math head (0), MT-Bench 3 of 4 by the chat head (1)
    _write(store, "eagle2", "confidence-routed", "gsm8k", [[2, 2, 2], [2]], heads=[[0, 0, 1], [0]])
    _write(store, "eagle2", "confidence-routed", "mt_bench", [[2, 2], [2, 2]], heads=[[1, 1], [1, 0]])
    _write(store, "eagle2", "entropy-routed", "gsm8k", [[1, 1], [1]], heads=[[0, 0], [1]])
    store.write_failure(Cell("eagle2", "merged-budget", "gsm8k", 0.0), "RuntimeError: out of memory\nTraceback ...", 2)
    return config, store


def test_report_tables_json_plots_and_findings(tmp_path):
    config, _ = _store(tmp_path)
    readme_path = build_report(config)
    readme = readme_path.read_text()
    out = readme_path.parent

    # tau recomputed from the rows; the average covers the benchmarks measured in the table (MT-Bench, GSM8K)
    math_row = f"| math head (mathinstruct 100%) | {_tau(BAD):.2f} | {_tau(GOOD):.2f} | – | – | {(_tau(BAD) + _tau(GOOD)) / 2:.2f} |"
    assert math_row in readme
    assert f"| mixed head (mathinstruct 50% + sharegpt 50%) | – | {_tau(MIXED):.2f} | – | – | – |" in readme
    assert "| merged-dedup (ours, not in TAPS) | – | – | – | – | – |" in readme
    # averaging sweep table, the single heads as its end points
    assert "| w = 0 (chat head) |" in readme and "| w = 0.25 |" in readme and "| w = 1 (math head) |" in readme
    # TAPS tau: Σ committed / Σ (steps − 1), e.g. math on GSM8K: 17 tokens / (2 + 1)
    assert f"| math head (mathinstruct 100%) | {7 / 3:.2f} | {17 / 3:.2f} |" in readme
    assert "Moe-Zbeeb/TAPS" in readme and "5.02 / 5.04" in readme  # the paper's own table, with its source
    assert "`RuntimeError: out of memory`" in readme and "Traceback" not in readme
    # speed: plain runs at 50 tok/s, math at 100 tok/s (2.00×); 1 of its 2 GSM8K answers equals plain's
    assert "| math | 100.0 (2.00×) · 0% | 100.0 (2.00×) · 50% |" in readme and "| plain | 50.0 (1.00×) · 100% |" in readme

    summary = json.loads((out / "summary.json").read_text())
    keys = {"head_kind", "proposer", "benchmark", "temperature", "tau", "tau_taps", "steps", "n_questions",
            "tokens_per_s", "speedup", "greedy_match"}
    assert all(keys <= set(row) for row in summary)
    math_gsm = next(r for r in summary if r["proposer"] == "math" and r["benchmark"] == "gsm8k")
    assert math_gsm["tau"] == pytest.approx(_tau(GOOD)) and math_gsm["n_questions"] == 2 and math_gsm["steps"] == 5
    for name in ("summary.parquet", "questions.parquet", "steps.parquet"):
        assert (out / "results" / name).stat().st_size > 0

    for png in ("tau_eagle2.png", "speedup_eagle2.png", "routing_eagle2.png", "entropy_eagle2.png", "averaging_eagle2.png"):
        assert (out / png).stat().st_size > 1000, png
        assert f"({png})" in readme

    for key in "abcdef":
        assert f"- **({key}) " in readme
    assert "The math head beats the chat head on GSM8K, MATH-500 and SVAMP, and the chat head beats the math head on " \
           "MT-Bench: HOLDS**" in readme
    assert "Δ from +1.500 nats" in readme
    # per question (TAPS): math wins both GSM8K questions on mean confidence; the live router's majority per question
    # gives MT-Bench question 1 (one step each) to the lower index, math; per step: 75% of steps each way
    assert "GSM8K 100% of 2 questions to math (per-question confidence) ✓" in readme
    assert "confidence-routed: 50% of questions by majority of steps, 75% of steps to chat" in readme
    assert "| EAGLE-2 | confidence-routed | T = 0 | MT-Bench | chat 50%, math 50% of questions |" in readme


def test_a_check_whose_interval_straddles_zero_is_within_noise(tmp_path):
    config = _config(tmp_path)
    store = ResultsStore(results_dir(config))
    # math better on question 0, chat on question 1: the point estimate favours math, the interval straddles zero
    _write(store, "eagle2", "math", "gsm8k", [[2, 2, 2], [0, 0]])
    _write(store, "eagle2", "chat", "gsm8k", [[0, 0, 0], [2, 2]])
    result = {f.key: f for f in findings(load_report_data(config, store))}
    assert result["a"].verdict == NOISE
    assert "GSM8K math 2.20 vs chat 1.80 ≈ (Δ +0.40, 95% CI [-" in result["a"].evidence[0]  # the interval's mark
    assert result["a"].evidence[0].startswith("EAGLE-2, T = 0: WITHIN NOISE")


def test_findings_follow_the_numbers(tmp_path):
    config, store = _store(tmp_path / "fwd", specialised=True)
    verdicts = {f.key: f.verdict for f in findings(load_report_data(config, store))}
    assert verdicts == {"a": HOLDS, "b": HOLDS, "c": HOLDS, "d": HOLDS, "e": HOLDS, "f": HOLDS, "g": UNMEASURED,
                        "h": UNMEASURED}

    config, store = _store(tmp_path / "rev", specialised=False)
    result = {f.key: f for f in findings(load_report_data(config, store))}
    assert result["a"].verdict == FAILS
    assert "GSM8K math 1.40 vs chat 3.40 ✗ (Δ -2.00, 95% CI [-" in result["a"].evidence[0]
    assert "intervals (2): 0 clearly for the claim, 2 clearly against it, 0 within noise" in result["a"].markdown()


@pytest.mark.parametrize("stronger", [True, False])
def test_specialisation_gain_of_eagle3_against_another_kind(tmp_path, stronger):
    config, store = _store(tmp_path)
    config.train.kinds = ["eagle2", "eagle3"]
    best = [[3, 3, 3], [3, 3]]  # τ 4.00, above GOOD on every question
    weak = [[1, 1, 1], [1, 1]]  # τ 2.00: between BAD and GOOD on every question
    for bench, (in_domain, other) in {"gsm8k": ("math", "chat"), "mt_bench": ("chat", "math")}.items():
        _write(store, "eagle3", in_domain, bench, best if stronger else weak)
        _write(store, "eagle3", other, bench, BAD)
    result = {f.key: f for f in findings(load_report_data(config, store))}["g"]
    assert result.verdict == (HOLDS if stronger else FAILS)
    gain = (_tau(best) if stronger else _tau(weak)) - _tau(BAD)
    assert f"EAGLE-3 {gain:+.2f}" in result.evidence[0] and f"EAGLE-2 {_tau(GOOD) - _tau(BAD):+.2f}" in result.evidence[0]
    assert result.intervals[0].delta == pytest.approx(gain - (_tau(GOOD) - _tau(BAD)))


def test_learned_router_against_confidence_routing_and_merged_trees(tmp_path):
    """(h): per benchmark against confidence routing, on average within 2% of merged trees, and its drafting cost
    read from the steps it verified merged (head -1)."""
    config, store = _store(tmp_path)
    _write(store, "eagle2", "learned-routed", "gsm8k", [[3, 3], [3]], heads=[[-1, 0], [0]])  # τ 4.00
    _write(store, "eagle2", "learned-routed", "mt_bench", [[3, 3], [3, 3]], heads=[[-1, 1], [1, 1]])  # τ 4.00
    result = {f.key: f for f in findings(load_report_data(config, store))}["h"]
    assert result.verdict == HOLDS
    evidence = result.evidence[0]
    assert "GSM8K 4.00 vs 3.00 ✓" in evidence and "MT-Bench 4.00 vs 3.00 ✓" in evidence
    assert "average 4.00 vs merged 3.50" in evidence
    assert "drafting cost: 29% merged steps, 1.29 heads drafted per step" in evidence  # mean of 1/3 and 1/4

    _write(store, "eagle2", "learned-routed", "mt_bench", [[0, 0], [0, 0]], heads=[[-1, 1], [1, 1]])  # τ 1.00
    assert {f.key: f for f in findings(load_report_data(config, store))}["h"].verdict == FAILS


def test_paired_bootstrap_interval_of_a_tau_difference(tmp_path):
    config = _config(tmp_path)
    store = ResultsStore(results_dir(config))
    _write(store, "eagle2", "math", "gsm8k", GOOD)
    _write(store, "eagle2", "chat", "gsm8k", BAD)
    # better on question 0 (τ 3 vs 1), worse on question 1 (τ 1 vs 3): no clear winner
    _write(store, "eagle2", "split", "gsm8k", [[2, 2, 2], [0, 0]])
    _write(store, "eagle2", "mirror", "gsm8k", [[0, 0, 0], [2, 2]])
    questions = load_report_data(config, store).questions

    clear = tau_difference(questions, "eagle2", 0.0, "math", "chat", ["gsm8k"])
    assert clear.delta == pytest.approx(_tau(GOOD) - _tau(BAD))  # the tables' pooled τ, not a mean of per-question τ
    assert clear.sign == 1 and clear.low > 0  # GOOD beats BAD on every question, so on every resample
    assert tau_difference(questions, "eagle2", 0.0, "chat", "math", ["gsm8k"]).sign == -1

    noisy = tau_difference(questions, "eagle2", 0.0, "split", "mirror", ["gsm8k"])
    assert noisy.delta == pytest.approx(11 / 5 - 9 / 5)
    assert noisy.low < 0 < noisy.high and noisy.sign == 0
    assert tau_difference(questions, "eagle2", 0.0, "math", "absent", ["gsm8k"]) is None

    low, high = tau_interval(questions, "eagle2", 0.0, "split", "gsm8k")  # per-question τ 3 and 1, pooled 2.2
    assert 1.0 <= low < 11 / 5 < high <= 3.0
    assert tau_interval(questions, "eagle2", 0.0, "absent", "gsm8k") is None


def test_unmeasured_claims_and_empty_store(tmp_path):
    config = _config(tmp_path)
    store = ResultsStore(results_dir(config))
    _write(store, "eagle2", "math", "gsm8k", GOOD)
    result = {f.key: f.verdict for f in findings(load_report_data(config, store))}
    assert result == dict.fromkeys("abcdfgh", UNMEASURED) | {"e": HOLDS}

    empty = _config(tmp_path / "empty")
    readme = build_report(empty).read_text()
    assert readme.count(UNMEASURED) == 16 and "*skipped*" in readme  # in the summary and under Findings
    assert json.loads((tmp_path / "empty" / "reports" / "summary.json").read_text()) == []


def test_report_rebuilds_from_its_own_results_copy(tmp_path):
    config, _ = _store(tmp_path)
    first = build_report(config).read_text()
    copy = results_source(tmp_path / "reports" / "results")
    assert isinstance(copy, ReportCopy)

    elsewhere = config.model_copy(update={"reports_dir": str(tmp_path / "again")})
    second = build_report(elsewhere, copy).read_text()
    # everything after the setting (which names the source and the time) is rebuilt identically, failures included
    assert first.split("## Acceptance length", 1)[1] == second.split("## Acceptance length", 1)[1]
    assert "`RuntimeError: out of memory`" in second
    assert sorted(p.name for p in (tmp_path / "again" / "results").iterdir()) == sorted(
        p.name for p in (tmp_path / "reports" / "results").iterdir())


def test_a_report_rebuilt_in_place_from_its_copy_keeps_the_copy(tmp_path, monkeypatch):
    """The committed report is rebuilt from its own results/ (`taps report --results reports/results`): the copy,
    whose steps stayed in the results store, stays as it is, and the README still says so."""
    monkeypatch.setattr(build, "STEPS_LIMIT_BYTES", 1)  # every store's steps count as too big to copy
    config, _ = _store(tmp_path)
    first = build_report(config).read_text()
    folder = tmp_path / "reports" / "results"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert "steps.parquet" not in before and "steps not copied" in first
    second = build_report(config, results_source(folder)).read_text()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    note = before["STEPS_NOT_COPIED.txt"].decode().strip()
    assert note in first and note in second
    # what the report reads of the steps travels in the copy: the entropy and routing findings come back decided
    assert first.split("## Acceptance length", 1)[1] == second.split("## Acceptance length", 1)[1]
    assert f"**(e) {HOLDS}**" in second and f"**(f) {UNMEASURED}**" not in second

    with pytest.raises(FileNotFoundError, match="neither a results store"):
        results_source(tmp_path / "nowhere")


def test_rendered_report_prints_no_machine_path(tmp_path, monkeypatch):
    """The store lives under tmp_path and a local data set under the data dir: both print without their prefix."""
    data_dir = tmp_path / "data"
    (data_dir / "gsm8k_train").mkdir(parents=True)
    (data_dir / "gsm8k_train" / "train.jsonl").write_text("")
    monkeypatch.setenv("TAPS_DATA_DIR", str(data_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # MathInstruct then resolves to the local GSM8K-train stand-in
    config, _ = _store(tmp_path)
    readme = build_report(config).read_text()
    assert "(local dir $TAPS_DATA_DIR/gsm8k_train/train.jsonl)" in readme
    assert "results store `…/work/results`" in readme
    assert str(tmp_path) not in readme and "/tmp/" not in readme and "site-packages" not in readme


def test_tau_taps_counts_a_one_step_turn_as_taps_does():
    """TAPS sums each turn's loop index (steps − 1): a one-step turn adds its tokens and no step."""
    cell = {"head_kind": "eagle2", "proposer": "math", "benchmark": "gsm8k", "temperature": 0.0, "wall_s": 1.0,
            "n_tokens": 1}
    rows = [{**cell, "question_id": "0", "turn": 0, "new_tokens": 9, "committed": 9, "steps": 3, "taps_steps": 2},
            {**cell, "question_id": "1", "turn": 0, "new_tokens": 4, "committed": 4, "steps": 1, "taps_steps": 0}]
    row = summarize(pd.DataFrame(rows)).iloc[0]
    assert row["tau_taps"] == pytest.approx(13 / 2) and row["tau"] == pytest.approx(13 / 4)
    alone = summarize(pd.DataFrame(rows[1:])).iloc[0]
    assert pd.isna(alone["tau_taps"])  # no turn took two steps: undefined, not 4 / 1


def test_greedy_agreement_counts_only_answers_plain_decoding_has():
    """A replayed cell covers the whole benchmark, plain decoding its first questions: the others are not misses."""
    base = {"benchmark": "gsm8k", "temperature": 0.0, "turn": 0, "wall_s": 1.0, "n_tokens": 2, "new_tokens": 2,
            "committed": 2, "steps": 1, "taps_steps": 0}
    plain = {**base, "head_kind": "none", "proposer": "plain"}
    math = {**base, "head_kind": "eagle2", "proposer": "math"}
    rows = [{**plain, "question_id": "0", "tokens": [1, 2]}, {**plain, "question_id": "1", "tokens": [3, 4]},
            {**math, "question_id": "0", "tokens": [1, 2]}, {**math, "question_id": "1", "tokens": [3, 5]},
            *({**math, "question_id": str(i), "tokens": [6, 7]} for i in range(2, 10))]
    summary = summarize(pd.DataFrame(rows)).set_index("proposer")
    assert summary.loc["math", "greedy_match"] == pytest.approx(0.5) and summary.loc["plain", "greedy_match"] == 1
    replayed = summarize(pd.DataFrame([{**r, "wall_s": float("nan")} if r["proposer"] == "math" else r for r in rows]))
    assert replayed.set_index("proposer")[["tokens_per_s", "speedup"]].loc["math"].isna().all()  # no speed, not ∞


def test_setting_states_that_router_signals_use_the_reduced_draft_vocabulary(tmp_path):
    config, store = _store(tmp_path)
    data = load_report_data(config, store)
    assert "renormalised on these tokens" not in setting_md(data, "taps report")
    reduced = config.model_copy(update={"tree": config.tree.model_copy(update={"draft_vocab_size": 512})})
    text = setting_md(load_report_data(reduced, store), "taps report")
    assert "draft vocabulary 512 tokens (draft confidence and entropy" in text and "not on the full vocabulary" in text


# --- the report leads with its answer (issue 44) ------------------------------------------------------------------


def test_the_report_leads_with_its_findings_and_main_table(tmp_path):
    config, _ = _store(tmp_path)
    readme = build_report(config).read_text()
    head, _, rest = readme.partition("## Setting")
    assert "## Summary" in head and "- **(a) HOLDS**: The math head beats the chat head" in head
    assert "| math head (mathinstruct 100%) |" in head  # the main τ table
    assert "Regenerate: `taps report --results " in head  # the copy holds its config
    assert "`eagle2/math/gsm8k/T0`" not in head + rest.split("## Appendix: the cells")[0]  # cell ids: appendix only
    assert "`eagle2/math/gsm8k/T0`" in rest.split("## Appendix: the cells")[1]
    # MT-Bench is the chat head's benchmark: its Δ is chat − math, positive when the claim holds there
    assert "MT-Bench chat 3.40 vs math 1.40 ✓ (Δ +2.00, 95% CI [+" in readme


def test_claim_verdicts_agree_with_their_intervals():
    above, straddling, below = Interval(0.3, 0.1, 0.5), Interval(0.1, -0.05, 0.2), Interval(-0.3, -0.5, -0.1)

    def claim(*settings: list[Interval]) -> Finding:
        finding = Finding("x", "claim", "paper")
        for i, intervals in enumerate(settings):
            finding.add("eagle2", float(i), "checks", intervals, [f"check {i}"] * len(intervals))
        return finding.decide()

    mostly = claim([above, above], [above], [straddling])
    assert mostly.verdict == MOSTLY and "within noise: EAGLE-2, T = 2 check 2 Δ +0.10" in mostly.summary_line()
    assert claim([above], [straddling], [straddling]).verdict == NOISE
    assert claim([above], [above]).verdict == HOLDS
    failing = claim([above], [below, straddling])
    assert failing.verdict == FAILS and "against it: EAGLE-2, T = 1 check 1 Δ -0.30" in failing.summary_line()


def test_one_colour_per_proposer_in_every_figure(tmp_path, monkeypatch):
    config, _ = _store(tmp_path)
    colours: dict[str, set] = {}
    save = plots._save

    def record(fig, path):
        for ax in fig.axes:
            for bars in ax.containers:
                label = bars.get_label()
                if not label.startswith("_") and "head" not in label and label not in ("accepted", "rejected"):
                    colours.setdefault(label, set()).add(tuple(bars.patches[0].get_facecolor()))
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", record)
    build_report(config)
    assert {"math", "chat", "confidence-routed", "merged"} <= set(colours)
    assert all(len(seen) == 1 for seen in colours.values()), colours
    assert len({next(iter(seen)) for seen in colours.values()}) == len(colours)  # and no two share one


def test_an_empty_speed_panel_says_the_cells_were_replayed():
    class Replayed:
        meta = [{"replayed": True, "head_kind": "eagle2", "temperature": 0.0}]

    assert "replayed" in plots._why_empty(Replayed(), "eagle2", 0.0, "speedup")
    assert plots._why_empty(Replayed(), "eagle2", 1.0, "speedup") == "no eagle2 cells at T = 1"


def test_rebuilding_keeps_what_else_the_results_folder_holds(tmp_path):
    """reports/results also holds benchmarks' JSON (host_overhead.json, ...): a rebuild replaces its own files only."""
    config, _ = _store(tmp_path)
    results = tmp_path / "reports" / "results"
    results.mkdir(parents=True)
    (results / "host_overhead.json").write_text("{}")
    build_report(config)
    build_report(config.model_copy(update={"reports_dir": str(tmp_path / "again")}), results_source(results))
    assert (results / "host_overhead.json").read_text() == "{}" and (results / "summary.parquet").is_file()
    assert not (tmp_path / "again" / "results" / "host_overhead.json").exists()
