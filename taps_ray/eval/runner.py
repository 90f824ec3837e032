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
from taps_ray.drafting.setup import load_proposers
from taps_ray.decoding.generate import run_loop
from taps_ray.decoding.step import Generation, Verifier
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.names import parse_proposer
from taps_ray.drafting.registry import draft_reach
from taps_ray.decoding.replay import GreedyTrace, moved, record_traces, replay
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams

VerifierFactory = Callable[[tuple[int, ...]], Verifier]  # the target layers the proposer drafts from -> verifier


def is_replayed(config: StudyConfig, cell: Cell) -> bool:
    """T = 0 cells of draft proposers are replayed when `eval.replay` is on; plain decoding stays live, as the
    speed baseline, and so do `auto-*` cells: the cost model decides from measured draft and verify times,
    which a replay does not have (drafting/cost.py)."""
    return (config.eval.replay and cell.temperature == 0 and cell.proposer != PLAIN
            and not parse_proposer(cell.proposer).auto)


def cell_questions(config: StudyConfig, cell: Cell) -> int:
    """How many of a benchmark's questions a cell evaluates: all of `eval.benchmarks` when replayed, at most
    `eval.live_questions` when it runs live."""
    count = config.eval.benchmarks[cell.benchmark]
    live = config.eval.live_questions
    return count if is_replayed(config, cell) or live is None else min(count, live)


class TraceCache:
    """Greedy traces by (question, turn) for one benchmark and one feature kind at a time (a trace holds features
    of every position, so only what is being evaluated stays in memory). The feature kind is the target layers a
    proposer drafts from: an EAGLE-3 head's traces carry its fused layers, the others the last layer. The greedy
    continuations stay for the whole benchmark, so a second feature kind costs one forward per question, not a
    second decode."""

    def __init__(self) -> None:
        self.benchmark: str | None = None
        self.layers: tuple[int, ...] = ()
        self.traces: dict[tuple[str, int], GreedyTrace] = {}
        self.decoded: dict[tuple[str, int], GreedyTrace] = {}  # any feature kind: its prompt and tokens

    def of(self, benchmark: str, layers: tuple[int, ...] = ()) -> dict[tuple[str, int], GreedyTrace]:
        if benchmark != self.benchmark:
            self.benchmark, self.decoded = benchmark, {}
            self.layers, self.traces = tuple(layers), {}
        elif tuple(layers) != self.layers:
            self.layers, self.traces = tuple(layers), {}
        return self.traces

    def continuation(self, key: tuple[str, int], prompt: list[int]) -> list[int] | None:
        """The recorded greedy tokens after `prompt` for `key`, when some feature kind traced it already."""
        known = self.decoded.get(key)
        return known.tokens if known is not None and known.prompt == prompt else None


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
    questions = load_questions(cell.benchmark, config.resolved_data_dir(), limit=cell_questions(config, cell))
    proposer = load_proposers(config, [cell.proposer], target=target, heads=heads)[cell.proposer]
    params = SamplingParams(temperature=cell.temperature)
    make_verifier = verifier_factory or (lambda layers: TargetBatch(target.model, feature_layers=layers))
    layers = proposer.feature_layers
    replayed = is_replayed(config, cell)
    cache = traces or TraceCache()
    known = cache.of(cell.benchmark, layers)
    budget = (evaluation.max_new_tokens, target.stop_token_ids)
    answers: dict[object, list[str]] = {q.question_id: [] for q in questions}
    step_rows: list[dict] = []
    question_rows: list[dict] = []
    turns = max(len(q.turns) for q in questions)
    # a replayed cell's questions decode together `eval.replay_batch` at a time, whatever `eval.batch_size` (which
    # sizes live cells, where speed is measured): a batched one-token forward costs little more than one
    batch_size = evaluation.replay_batch if replayed else evaluation.batch_size
    for turn in range(turns):
        todo: list[Question] = [q for q in questions if len(q.turns) > turn]
        for batch in _batches(todo, batch_size):
            prompts = [
                build_prompt_ids(target.tokenizer, q.turns[: turn + 1], answers[q.question_id], evaluation.system_prompt)
                for q in batch
            ]
            seeds = [question_seed(evaluation.seed, q.question_id, turn) for q in batch]
            if replayed:
                keys = [(str(q.question_id), turn) for q in batch]
                traced = _traces(cache, known, keys, prompts, lambda: make_verifier(layers), config, target)
                generations = _replayed(proposer, traced, budget, target.device, evaluation.traces_on_host)
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
    cache: TraceCache,
    known: dict[tuple[str, int], GreedyTrace],
    keys: list[tuple[str, int]],
    prompts: list[list[int]],
    make_verifier: Callable[[], Verifier],
    config: StudyConfig,
    target: Target,
) -> list[GreedyTrace]:
    """The traces of a batch; the questions not yet traced are decoded together (one target run per question),
    those another feature kind decoded already only get their features."""
    todo = [i for i, key in enumerate(keys) if key not in known or known[key].prompt != prompts[i]]
    for decoded in (True, False):
        group = [i for i in todo if (cache.continuation(keys[i], prompts[i]) is not None) == decoded]
        if not group:
            continue
        new = record_traces(
            make_verifier, [prompts[i] for i in group], config.eval.max_new_tokens, target.stop_token_ids,
            draft_reach(config.tree),
            continuations=[cache.continuation(keys[i], prompts[i]) for i in group] if decoded else None,
        )
        if config.eval.traces_on_host:
            new = [moved(trace, "cpu") for trace in new]
        known.update((keys[i], trace) for i, trace in zip(group, new))
        cache.decoded.update((keys[i], trace) for i, trace in zip(group, new))
    return [known[key] for key in keys]


def _replayed(proposer: Proposer, traces: list[GreedyTrace], budget: tuple[int, list[int]], device: torch.device,
              on_host: bool) -> list[Generation]:
    """`replay` on the drafter's device; traces kept on the host go there for this batch, and the trees drafted
    along them come back to the host with them."""
    if not on_host:
        return replay(proposer, traces, *budget)
    local = [moved(trace, device) for trace in traces]
    generations = replay(proposer, local, *budget)
    for kept, used in zip(traces, local):
        kept.drafted.update(moved(used, "cpu").drafted)
    return generations


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
