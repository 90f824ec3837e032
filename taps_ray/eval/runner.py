"""Evaluate one cell (proposer × benchmark × temperature) into step and question records.

Questions are decoded in batches, turn by turn (MT-Bench turn 2 sees the answer to turn 1). A live cell runs
the engine's `run_loop`; the caller chooses where the target side runs (in-process or a Ray worker). A replayed
cell (T = 0 with `eval.replay`, see `is_replayed`) replays the proposer against greedy traces (spec/replay.py)
that a `TraceCache` keeps across cells, so the target decodes each question once for all proposers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch

from taps_ray.config import StudyConfig
from taps_ray.data.chat import build_prompt_ids
from taps_ray.data.sources import Question, load_questions
from taps_ray.eval.cell import PLAIN, Cell
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.target import Target
from taps_ray.proposer_setup import load_proposers
from taps_ray.engine.generate import Generation, Verifier, run_loop
from taps_ray.engine.proposers import feature_layers
from taps_ray.engine.registry import draft_reach
from taps_ray.engine.replay import GreedyTrace, record_traces, replay
from taps_ray.engine.target_batch import TargetBatch
from taps_ray.engine.verify import SamplingParams

VerifierFactory = Callable[[tuple[int, ...]], Verifier]  # the target layers the proposer drafts from -> verifier


def is_replayed(config: StudyConfig, cell: Cell) -> bool:
    """T = 0 cells of draft proposers are replayed when `eval.replay` is on; plain decoding stays live, as the
    speed baseline."""
    return config.eval.replay and cell.temperature == 0 and cell.proposer != PLAIN


class TraceCache:
    """Greedy traces by (question, turn) for one benchmark and one feature kind at a time (a trace holds features
    of every position, so only what is being evaluated stays in memory). The feature kind is the target layers a
    proposer drafts from: an EAGLE-3 head's traces carry its fused layers, the others the last layer."""

    def __init__(self) -> None:
        self.key: tuple[str, tuple[int, ...]] | None = None
        self.traces: dict[tuple[str, int], GreedyTrace] = {}

    def of(self, benchmark: str, layers: tuple[int, ...] = ()) -> dict[tuple[str, int], GreedyTrace]:
        if (benchmark, tuple(layers)) != self.key:
            self.key, self.traces = (benchmark, tuple(layers)), {}
        return self.traces


def question_seed(base: int, question_id: object, turn: int) -> int:
    """A seed per (question, turn) so a question samples the same way alone, in a batch, or through Ray."""
    digest = hashlib.sha256(f"{base}:{question_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _batches(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def answer_text(target: Target, generation: Generation) -> str:
    return target.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip()


def run_cell(
    config: StudyConfig,
    cell: Cell,
    target: Target,
    heads: dict[str, DraftHead],
    verifier_factory: VerifierFactory | None = None,
    progress: Callable[[int], None] | None = None,
    traces: TraceCache | None = None,
) -> tuple[list[dict], list[dict]]:
    """Returns the cell's (steps, questions) records, one dict per decoding step and one per question and turn
    (plain rows: a drafter returns them without pandas; `ResultsStore.write_cell` makes the frames);
    `progress(n)` is called after each batch of n answers.
    A replayed cell reads and fills `traces` (pass one cache to every cell of a run to share the target's decodes)."""
    evaluation = config.eval
    questions = load_questions(cell.benchmark, config.resolved_data_dir(), limit=evaluation.benchmarks[cell.benchmark])
    proposer = load_proposers(config, [cell.proposer], target=target, heads=heads)[cell.proposer]
    params = SamplingParams(temperature=cell.temperature)
    make_verifier = verifier_factory or (lambda layers: TargetBatch(target.model, feature_layers=layers))
    layers = feature_layers(proposer)
    replayed = is_replayed(config, cell)
    known = (traces or TraceCache()).of(cell.benchmark, layers)
    budget = (evaluation.max_new_tokens, target.stop_token_ids)
    answers: dict[object, list[str]] = {q.question_id: [] for q in questions}
    step_rows: list[dict] = []
    question_rows: list[dict] = []
    turns = max(len(q.turns) for q in questions)
    for turn in range(turns):
        todo: list[Question] = [q for q in questions if len(q.turns) > turn]
        for batch in _batches(todo, evaluation.batch_size):
            prompts = [
                build_prompt_ids(target.tokenizer, q.turns[: turn + 1], answers[q.question_id], evaluation.system_prompt)
                for q in batch
            ]
            seeds = [question_seed(evaluation.seed, q.question_id, turn) for q in batch]
            if replayed:
                keys = [(str(q.question_id), turn) for q in batch]
                traced = _traces(known, keys, prompts, lambda: make_verifier(layers), config, target)
                generations = replay(proposer, traced, *budget)
            else:
                generations = run_loop(make_verifier(layers), proposer, prompts, params, *budget, seeds)
            batch_tokens = sum(len(g.tokens) for g in generations) or 1
            for question, generation in zip(batch, generations):
                answers[question.question_id].append(answer_text(target, generation))
                base = {**cell.as_dict(), "question_id": str(question.question_id), "turn": turn}
                question_rows.append(_question_row(base, generation, batch_tokens))
                step_rows.extend({**base, "step": i, **vars(step)} for i, step in enumerate(generation.steps))
            if progress is not None:
                progress(len(batch))
    return step_rows, question_rows


def _traces(
    known: dict[tuple[str, int], GreedyTrace],
    keys: list[tuple[str, int]],
    prompts: list[list[int]],
    make_verifier: Callable[[], Verifier],
    config: StudyConfig,
    target: Target,
) -> list[GreedyTrace]:
    """The traces of a batch; the questions not yet traced are decoded together (one target run per question)."""
    todo = [i for i, key in enumerate(keys) if key not in known or known[key].prompt != prompts[i]]
    if todo:
        new = record_traces(
            make_verifier, [prompts[i] for i in todo], config.eval.max_new_tokens, target.stop_token_ids,
            draft_reach(config.tree),
        )
        known.update((keys[i], trace) for i, trace in zip(todo, new))
    return [known[key] for key in keys]


def _question_row(base: dict, generation: Generation, batch_tokens: int) -> dict:
    steps = len(generation.steps)
    return {
        **base,
        "prompt_tokens": len(generation.prompt),
        "tokens": list(generation.tokens),
        "n_tokens": len(generation.tokens),
        "new_tokens": sum(s.new_tokens for s in generation.steps),
        "committed": sum(s.accepted + 1 for s in generation.steps),
        "steps": steps,
        "taps_steps": steps - 1,  # TAPS sums (steps - 1) per turn: a one-step turn adds tokens but no step
        "tau": generation.tau,
        # a batch's wall time is shared out by tokens, so Σ wall over a cell is the time it took
        "wall_s": generation.wall_s * len(generation.tokens) / batch_tokens,
        "finished_by": generation.finished_by,
    }


def eval_dtype(config: StudyConfig) -> torch.dtype:
    return getattr(torch, config.eval.dtype or config.target.dtype)
