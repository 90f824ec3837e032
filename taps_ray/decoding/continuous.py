"""Continuous batching: requests join the running batch between verification steps and leave when finished.

`ContinuousBatcher.step` is one scheduling iteration: admit waiting requests (prefill them together, then
merge their cache rows into the running `TargetBatch`), run the loop's own step over the live sequences
(`step.decode_step`: a tree per sequence with that sequence's own proposer and state, every tree verified in ONE
target forward, commit, record), and drop the finished rows. Requests for different proposers and with different
sampling parameters share the forward (parameters are per row).

Exact like `run_loop`, whose step it is: a sequence's tokens depend only on its prompt, parameters and seed (at
T=0 they equal plain greedy decoding) whoever shares its batch, and its `DraftGate` decides per step from the live
batch size whether the batch drafts (a fixed `draft_below` cap, as in the other loops, or Serve's measured rule:
draft where drafted steps commit more tokens per second than undrafted ones at this batch size). What Serve adds
is its sequences' commit (`_Sequence.commit`):
text-level stop conditions (stop strings) come in as `Request.stop`, so decoding ends at the step that completes
one; log-probabilities; streaming each step's tokens.

One request type from the HTTP body to the engine: Serve builds a `Request` once from the validated body and
hands it down unchanged. The caller's callbacks (`on_tokens`, `on_done`, and `on_commit` for a request Serve records
for online adaptation) are arguments of `submit`, kept with the sequence, never written onto the request; `submit`
returns the function that cancels it.

Plain PyTorch, no Ray and no asyncio: the caller runs `step` in one worker thread and hears back through the
callbacks (called from that thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from taps_ray.decoding.draft_gate import DraftGate
from taps_ray.decoding.step import Decoding, Drafting, Generation, decode_step
from taps_ray.decoding.target_batch import Committed, TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposer import NOT_DRAFTED, Proposer

if TYPE_CHECKING:  # an annotation only: importing the class loads transformers' model code
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """One output token's log-probability under the target's raw distribution, and the most likely tokens."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Result:
    generation: Generation
    logprobs: list[TokenLogprob] = field(default_factory=list)
    max_batch: int = 0  # the most sequences that shared one of this request's verification steps
    error: str | None = None


@dataclass(frozen=True)
class Request:
    """One sequence to decode, as Serve validated it: the engine only reads it."""

    prompt: list[int]
    proposer: Proposer
    params: SamplingParams
    max_tokens: int
    seed: int
    top_logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely
    stop: Callable[[list[int], int], int | None] | None = None  # (tokens, new) -> cut length if the last `new` ended it
    ignore_eos: bool = False  # decode past the stop tokens, to max_tokens (vLLM's extension, for benchmarks)


OnTokens = Callable[[list[int], list[TokenLogprob]], None]  # what each step added
OnDone = Callable[[Result], None]
OnCommit = Callable[[Committed], None]  # what the target committed (features and tokens), before any cut


@dataclass
class _Sequence(Decoding):
    """A request's sequence: the loop's `Decoding` plus what Serve adds to each commit, and the caller's
    callbacks (run on the decoding thread: they must be quick)."""

    request: Request = field(kw_only=True)
    on_tokens: OnTokens | None = field(default=None, kw_only=True)
    on_done: OnDone | None = field(default=None, kw_only=True)
    on_commit: OnCommit | None = field(default=None, kw_only=True)
    cancelled: bool = False  # set from any thread (`cancel`): the sequence leaves at the next step
    logprobs: list[TokenLogprob] = field(default_factory=list)
    max_batch: int = 0
    admitted: float = 0.0

    def cancel(self) -> None:
        self.cancelled = True

    def commit(self, committed: Committed) -> int:
        """The loop's commit, then a completed stop string cuts the output (`Request.stop`), the kept tokens'
        log-probabilities are read and the client hears of them. Returns the tokens kept, which Serve's step
        records count (the client's tokens per step: cut at the budget and at a stop string too)."""
        request, generation = self.request, self.generation
        if self.on_commit is not None:  # a recorded request (Serve's online adaptation): the verify's own features
            self.on_commit(committed)
        before = len(generation.tokens)
        kept = self.extend(committed)
        if request.stop is not None and kept:
            cut = request.stop(generation.tokens, kept)
            if cut is not None:
                del generation.tokens[max(cut, before) :]
                kept, generation.finished_by = len(generation.tokens) - before, "stop"
        new = generation.tokens[before:]
        logprobs = _logprobs(committed, new, request.top_logprobs) if request.top_logprobs is not None else []
        self.logprobs.extend(logprobs)
        if new and self.on_tokens is not None:
            try:
                self.on_tokens(new, logprobs)
            except Exception:  # a vanished client must not stop the batch
                logger.debug("on_tokens failed", exc_info=True)
        return kept


def _logprobs(committed: Committed, tokens: list[int], top: int) -> list[TokenLogprob]:
    table = committed.target_logprobs()[: len(tokens)]
    best = table.topk(min(top, table.shape[-1]), dim=-1) if top else None
    out = []
    for i, token in enumerate(tokens):
        pairs = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
        out.append(TokenLogprob(token, float(table[i, token]), pairs))
    return out


class ContinuousBatcher:
    """The running batch of one replica. `submit` is thread-safe; `step` runs on one thread at a time."""

    def __init__(
        self, model: PreTrainedModel, stop_ids: list[int], max_batch_size: int, gate: DraftGate | None = None,
        feature_layers: tuple[int, ...] = (), node_stats: bool = False, prefill_tokens: int | None = None,
    ) -> None:
        """`gate`: whether a step drafts (None: always); it hears every step's time and tokens while a drafting
        proposer is in the batch. `feature_layers`: the target layers the replica's proposers draft from
        (`Proposer.feature_layers`).
        `node_stats`: keep per-node diagnostics in the step records (`step.decode_step`), off unless asked: Serve
        reports none of them. `prefill_tokens`: the most prompt tokens one scheduling iteration prefills (at least
        one request is admitted), so a flood of joining requests is admitted over several steps and the running
        sequences keep decoding between them (vLLM's per-step token budget, at request granularity); None: no
        limit."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if prefill_tokens is not None and prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be at least 1 (or None: no limit), got {prefill_tokens}")
        self.model, self.stop_ids = model, set(stop_ids)
        self.max_batch_size, self.prefill_tokens = max_batch_size, prefill_tokens
        self.gate = gate if gate is not None else DraftGate()
        self.feature_layers, self.node_stats = feature_layers, node_stats
        self._waiting: deque[_Sequence] = deque()
        self._lock = threading.Lock()
        self._running: list[_Sequence] = []  # in the row order of `_batch`
        self._batch: TargetBatch | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def live(self) -> int:
        return len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    def submit(
        self, request: Request, on_tokens: OnTokens | None = None, on_done: OnDone | None = None,
        on_commit: OnCommit | None = None,
    ) -> Callable[[], None]:
        """Queue `request`; returns the function that cancels it (from any thread: it leaves at the next step).
        `on_commit` hears every `Committed` of the sequence (the prefill's and each step's) on the decoding thread."""
        if request.max_tokens < 1 or not request.prompt:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        with self._lock:
            drafting = Drafting(request.proposer, request.proposer.init_state())
            stops = set() if request.ignore_eos else self.stop_ids
            seq = _Sequence(Generation(prompt=list(request.prompt)), drafting, request.max_tokens, stops,
                            request=request, on_tokens=on_tokens, on_done=on_done, on_commit=on_commit)
            self._waiting.append(seq)
        return seq.cancel

    def step(self) -> None:
        """Admit what fits, then one verification step over every live sequence. With a running batch whose
        target forward can (`TargetBatch.joins_in_step`), the joining requests are prefilled inside that step's
        forward; otherwise they are prefilled first, in groups of similar lengths."""
        for seq in self._running:
            if seq.cancelled and not seq.generation.finished_by:
                seq.generation.finished_by = "cancelled"
        self._drop_finished()
        joining = self._take_fresh() if self._running and self._batch.joins_in_step else None
        if joining is None:
            self._admit()
            self._drop_finished()  # a request can finish with its first token
        if not self._running:
            return
        try:
            self._verify(joining or [])
        except Exception as error:  # the batch's state is unknown: fail its sequences, keep serving the rest
            logger.exception("a verification step over %d sequences failed", len(self._running))
            self._fail([*self._running, *(joining or [])], error)
            self._running, self._batch = [], None
        self._drop_finished()

    def fail_all(self, reason: str) -> None:
        """End every waiting and live request with an error (shutdown)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        self._fail([*waiting, *self._running], RuntimeError(reason))
        self._running, self._batch = [], None

    # -- scheduling ------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit what fits the batch and the prefill budget, prefilled in groups of similar prompt lengths; the
        joined rows then take their arrival order, so sequences draft in the order they came, as in the other
        loops (a proposer drawing from a shared generator sees the same calls)."""
        fresh = self._take_fresh()
        before = len(self._running)
        for group in length_groups(fresh):
            self._prefill(group)
        arrival = {id(seq): rank for rank, seq in enumerate(fresh)}
        joined = sorted(range(before, len(self._running)), key=lambda row: arrival[id(self._running[row])])
        if joined != list(range(before, len(self._running))):
            rows = [*range(before), *joined]
            self._batch.keep_rows(rows)
            self._running = [self._running[row] for row in rows]

    def _take_fresh(self) -> list[_Sequence]:
        """The waiting requests this iteration admits, in arrival order: up to the batch's free rows and the
        prefill budget (the first always fits); cancelled ones finish here."""
        fresh: list[_Sequence] = []
        budget = self.prefill_tokens
        with self._lock:
            while self._waiting and len(self._running) + len(fresh) < self.max_batch_size:
                seq = self._waiting[0]
                if seq.cancelled:
                    self._finish(self._waiting.popleft(), "cancelled")
                    continue
                if budget is not None and fresh and len(seq.request.prompt) > budget:
                    break
                fresh.append(self._waiting.popleft())
                budget = None if budget is None else budget - len(seq.request.prompt)
        return fresh

    def _prefill(self, fresh: list[_Sequence]) -> None:
        """Prefill `fresh` in one right-padded forward, commit their first tokens and merge their rows into the
        running batch."""
        batch = self._new_batch()
        try:
            t0 = time.perf_counter()
            started = batch.start(
                [s.request.prompt for s in fresh], [s.request.params for s in fresh], [s.request.seed for s in fresh]
            )
        except Exception as error:
            logger.exception("prefilling %d requests failed", len(fresh))
            self._fail(fresh, error)
            return
        self._join(fresh, batch, started, t0)

    def _new_batch(self) -> TargetBatch:
        return TargetBatch(self.model, keep_logits=True, feature_layers=self.feature_layers)

    def _join(self, fresh: list[_Sequence], batch: TargetBatch, started: list[Committed], t0: float) -> None:
        """Prefilled sequences (since `t0`) commit their first tokens; their rows join the running batch."""
        prefill_s = time.perf_counter() - t0
        for seq, committed in zip(fresh, started, strict=True):
            seq.generation.prefill_s, seq.admitted = prefill_s, t0
            seq.commit(committed)
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.merge(batch, self.max_batch_size)
        self._running.extend(fresh)

    def _verify(self, joining: list[_Sequence]) -> None:
        """One `decode_step` over the running batch (its rows, in order; none is finished here), drafted if the gate
        says so, with the `joining` requests prefilled in the same forward (`TargetBatch.step_joining`); they then
        join the batch. The gate hears how the step went when a proposer in the batch drafts at all and nobody
        joined (a prefill's time is not the step's); a step it let draft counts as drafted only where some sequence
        verified a drafted tree. A cost-aware proposer paused on every sequence verifies roots only, at an
        undrafted step's cost: counted as drafted, such steps made the two kinds' rates equal at 16 in flight, and
        the gate drafted there, paying for the proposers' catch-up and probes (steps of 145-500 ms against 40)."""
        rows = list(range(len(self._running)))
        gated = any(seq.drafting.proposer.drafts for seq in self._running)
        self_timed = all(seq.drafting.proposer.times_itself for seq in self._running)
        drafting = gated and self.gate.drafts(len(rows), self_timed, timed=not joining)
        newcomer = self._new_batch() if joining else None  # a batch for the joiners only when there are some
        started: list[Committed] = []

        def verify(trees: list) -> list:
            if newcomer is None:
                return self._batch.step(trees, rows)
            results, first = self._batch.step_joining(trees, newcomer, [s.request.prompt for s in joining],
                                                      [s.request.params for s in joining],
                                                      [s.request.seed for s in joining])
            started.extend(first)
            return results

        t0 = time.perf_counter()
        tokens = decode_step(self._running, verify, drafting, self.node_stats)
        if gated and not joining:
            drafted = drafting and any(seq.drafting.head != NOT_DRAFTED for seq in self._running)
            self.gate.observe(len(rows), drafted, time.perf_counter() - t0, tokens, self_timed)
        for seq in self._running:
            seq.max_batch = max(seq.max_batch, len(rows) + len(joining))
        if newcomer is not None:
            self._join(joining, newcomer, started, t0)

    def _drop_finished(self) -> None:
        done = [s for s in self._running if s.generation.finished_by]
        if not done:
            return
        for seq in done:
            self._finish(seq, seq.generation.finished_by)
        keep = [row for row, s in enumerate(self._running) if not s.generation.finished_by]
        self._running = [self._running[row] for row in keep]
        if not keep:
            self._batch = None
        else:
            self._batch.keep_rows(keep)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        seq.generation.finished_by = reason
        seq.generation.wall_s = time.perf_counter() - seq.admitted if seq.admitted else 0.0
        if seq.on_done is not None:
            try:
                seq.on_done(Result(seq.generation, seq.logprobs, seq.max_batch, error))
            except Exception:
                logger.debug("on_done failed", exc_info=True)

    def _fail(self, seqs: list[_Sequence], error: BaseException) -> None:
        """End each sequence: an error unless it had already finished (then its result is whole)."""
        for seq in seqs:
            if seq.generation.finished_by:
                self._finish(seq, seq.generation.finished_by)
            else:
                self._finish(seq, "error", f"{type(error).__name__}: {error}")


PAD_SLACK = 1.25  # a prefill group's padded slots may exceed its real prompt tokens by this factor


def length_groups(fresh: list[_Sequence]) -> list[list[_Sequence]]:
    """`fresh` split into prefill groups of similar prompt lengths (sorted, longest first), each as wide as its
    longest prompt with at most `PAD_SLACK` times its real tokens in padded slots: a right-padded prefill of ragged
    prompts computes every padded slot, so a 30-token question beside a 300-token one would cost ten times its own
    work; a few narrower forwards cost less."""
    groups: list[list[_Sequence]] = []
    for seq in sorted(fresh, key=lambda s: -len(s.request.prompt)):
        group = groups[-1] if groups else None
        if group is not None:
            width, real = len(group[0].request.prompt), sum(len(s.request.prompt) for s in group)
            if width * (len(group) + 1) <= PAD_SLACK * (real + len(seq.request.prompt)):
                group.append(seq)
                continue
        groups.append([seq])
    return groups
