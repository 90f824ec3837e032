"""`taps eval` (the evaluation matrix, in-process, resumable) and `taps generate` (one prompt, with speedup)."""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

from tqdm import tqdm

from taps_ray.config import StudyConfig
from taps_ray.data.chat import build_prompt_ids
from taps_ray.decoding.generate import generate
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.registry import check_name
from taps_ray.drafting.setup import (
    check_proposers,
    head_names,
    heads_needed,
    load_heads,
    load_proposers,
    with_searched,
)
from taps_ray.eval.cell import NO_HEAD, PLAIN, Cell
from taps_ray.eval.metrics import summarize
from taps_ray.eval.runner import TraceCache, cell_questions, eval_dtype, is_replayed, run_cell
from taps_ray.eval.store import ResultsStore
from taps_ray.fsio import atomic_write_parquet
from taps_ray.models.target import dtype_name, load_target
from taps_ray.workdir import SEARCHED, results_dir


def plan_cells(
    config: StudyConfig,
    kinds: list[str] | None = None,
    proposers: list[str] | None = None,
    benchmarks: list[str] | None = None,
    temperatures: list[float] | None = None,
) -> list[Cell]:
    """Plain decoding once per benchmark and temperature, then every proposer of every head kind that has its
    heads (a `train.compare` head is trained for its own kinds only; the config's list gains `searched` for a kind
    whose mixture-search head exists, `drafting.setup.with_searched`). With
    `eval.replay` the T = 0 cells of draft proposers are replayed (runner.is_replayed), the rest run live; the
    cells of one benchmark and temperature are consecutive, so replayed cells share that benchmark's greedy
    decodes (runner.TraceCache holds one benchmark at a time). At T > 0 the proposers are `eval.live_proposers`
    when set (an explicit `proposers` argument overrides both lists)."""
    kinds = kinds or config.train.kinds
    # a typo fails here, before any model loads; an alias (`routed`) is evaluated under the name it stands for
    proposers = [check_name(name, [*config.head_mixtures(), SEARCHED]).name for name in proposers or ()]
    benchmarks = benchmarks or list(config.eval.benchmarks)
    temperatures = temperatures if temperatures is not None else config.eval.temperatures

    def proposers_at(temperature: float, kind: str) -> list[str]:
        if proposers:
            return [p for p in proposers if p != PLAIN]
        listed = (config.eval.live_proposers if temperature > 0 else None) or config.eval.proposers
        return [p for p in with_searched(config, kind, listed) if p != PLAIN]

    def has_heads(kind: str, proposer: str) -> bool:
        return set(heads_needed(config, [proposer])) <= set(head_names(config, kind))

    cells = [Cell(NO_HEAD, PLAIN, b, t) for t in temperatures for b in benchmarks]
    cells += [Cell(k, p, b, t) for t in temperatures for b in benchmarks for k in kinds for p in proposers_at(t, k)
              if has_heads(k, p)]
    return cells


def results_store(config: StudyConfig) -> ResultsStore:
    return ResultsStore(results_dir(config))


def refresh_summary(config: StudyConfig, store: ResultsStore) -> None:
    atomic_write_parquet(store.root / "summary.parquet", summarize(store.questions()))


def cmd_eval(config: StudyConfig, cells: list[Cell]) -> int:
    """Evaluate every unfinished cell in-process; a failing cell is recorded and the rest go on."""
    store = results_store(config)
    todo = [c for c in cells if not store.is_done(c)]
    print(f"{len(cells) - len(todo)} of {len(cells)} cells already in {store.root}; {len(todo)} to run")
    if not todo:
        refresh_summary(config, store)
        return 0
    target = load_target(config.target, dtype=config.eval.dtype)
    heads_by_kind = {  # only the heads these cells draft with: `--proposers math` needs no chat head
        kind: load_heads(config, kind, eval_dtype(config),
                         heads_needed(config, [c.proposer for c in todo if c.head_kind == kind]), target.device)
        for kind in sorted({c.head_kind for c in todo} - {NO_HEAD})
    }
    answers = sum(_answers_per_cell(config, c) for c in todo)
    traces = TraceCache()  # replayed cells of one benchmark share its greedy decodes (plan_cells keeps them together)
    failed = 0
    with tqdm(total=answers, desc="eval", unit="answer") as bar:
        for cell in todo:
            bar.set_postfix_str(cell.id)
            try:
                steps, questions = run_cell(
                    config, cell, target, heads_by_kind.get(cell.head_kind, {}), progress=bar.update, traces=traces
                )
            except Exception as error:  # recorded, and the sweep goes on
                failed += 1
                store.write_failure(cell, f"{type(error).__name__}: {error}\n{traceback.format_exc()}", attempts=1)
                print(f"cell {cell.id} failed: {error}", file=sys.stderr)
                continue
            meta = {"target": config.target.name, "dtype": str(eval_dtype(config)), "replayed": is_replayed(config, cell)}
            store.write_cell(cell, steps, questions, meta=meta)
    refresh_summary(config, store)
    return 1 if failed else 0


def _answers_per_cell(config: StudyConfig, cell: Cell) -> int:
    n = cell_questions(config, cell)
    return 2 * n if cell.benchmark == "mt_bench" else n


def cmd_generate(
    config: StudyConfig,
    proposer_name: str,
    prompt: str,
    kind: str,
    temperature: float,
    max_new_tokens: int,
    dtype: str | None,
    as_json: bool,
    seed: int = 0,
    repetitions: int = 2,
) -> int:
    """Decode one chat prompt with plain decoding and with the proposer; report tau and the speedup.

    One untimed warm-up run of each, then `repetitions` timed runs of each, interleaved (plain, proposer, plain,
    ...), so a one-off cost (first allocations, a busy neighbour) does not decide the figure: one cold run each
    gave 0.30x and 0.41x for the same prompt. The speedup is the ratio of the median times."""
    [proposer_name] = check_proposers(config, [proposer_name], kind)  # before the model: a typo fails at once
    target = load_target(config.target, dtype=dtype)
    proposers = load_proposers(config, [PLAIN, proposer_name], target=target, kind=kind)
    prompt_ids = build_prompt_ids(target.tokenizer, [prompt], [], config.eval.system_prompt)
    params = SamplingParams(temperature=temperature)

    def timed(candidate) -> tuple:
        start = time.perf_counter()
        generation = generate(target.model, candidate, [prompt_ids], params, max_new_tokens, target.stop_token_ids,
                              [seed])[0]
        return generation, time.perf_counter() - start

    for candidate in proposers.values():
        timed(candidate)
    walls: dict[str, list[float]] = {name: [] for name in proposers}
    outputs = {}
    for _ in range(repetitions):
        for name, candidate in proposers.items():
            outputs[name], wall = timed(candidate)
            walls[name].append(wall)
    generation, plain_generation = outputs[proposer_name], outputs[PLAIN]
    tokens_per_s = len(generation.tokens) / statistics.median(walls[proposer_name])
    plain_tokens_per_s = len(plain_generation.tokens) / statistics.median(walls[PLAIN])
    ratios = [(len(generation.tokens) / w) / (len(plain_generation.tokens) / p)
              for w, p in zip(walls[proposer_name], walls[PLAIN])]
    identical = generation.tokens == plain_generation.tokens
    dtype_label = dtype_name(target.dtype)
    result = {
        "proposer": proposer_name,
        "text": target.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip(),
        "tokens": generation.tokens,
        "tau": generation.tau,
        "tau_taps": generation.tau_taps,
        "steps": len(generation.steps),
        "tokens_per_s": tokens_per_s,
        "plain_tokens_per_s": plain_tokens_per_s,
        "speedup": tokens_per_s / plain_tokens_per_s,
        "speedup_range": [min(ratios), max(ratios)],
        "repetitions": repetitions,
        "identical_to_plain": identical,
        "note": _mismatch_note(identical, dtype_label),
        "temperature": temperature,
        "dtype": dtype_label,
    }
    if as_json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(
            f"\n[{proposer_name}] tau {result['tau']:.2f} over {result['steps']} steps · {tokens_per_s:.1f} tok/s · "
            f"plain {plain_tokens_per_s:.1f} tok/s · speedup {result['speedup']:.2f}× (median of {repetitions} "
            f"interleaved warm runs each; per run {min(ratios):.2f}-{max(ratios):.2f}×) · identical to plain: "
            f"{identical}" + (f"\n{result['note']}" if result["note"] else "")
        )
    return 0


def _mismatch_note(identical: bool, dtype: str) -> str:
    """Why speculative output may differ from plain: rounding in a 16-bit dtype, not a wrong acceptance."""
    if identical or dtype == "float32":
        return ""
    return (f"note: in {dtype} a forward over a draft tree and a one-token forward round differently, so a near tie "
            "between two tokens can break the other way; this is rounding, not a bug (--dtype fp32 decodes "
            "token for token as plain)")
