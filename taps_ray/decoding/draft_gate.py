"""Whether a step drafts: a batch-size cap, and (Serve) the measured rule that drafts only where it pays.

Why a batch-level rule: a drafted tree widens every row of the batch's one target forward, so what speculation
buys depends on how many sequences share the step. At batch 1 a forward is memory-bound and a 16-node tree costs
little more than one token; at batch 16 on a CPU the forward is compute-bound and every tree node costs nearly a
token. A per-sequence cost model (`drafting/cost.py`) times its own steps, which include every other row's tree,
and cannot tell its tree from its neighbours'.

`DraftGate` decides per step from the number of live sequences:
* `draft_below`: never draft at or above this batch size (a fixed cap, every loop's rule);
* a batch of one sequence whose proposer times itself (`Proposer.times_itself`: the cost model) drafts as that
  proposer decides: its timings hold no neighbour's tree, and its expected tokens (from the tree's confidences)
  are steadier than a few steps' committed ones. At 1 in flight (fp32, AMD EPYC, a chain of 3 from the interop
  math head) the measured rule below ran 3-4 drafted steps per request, the first paying the head's catch-up
  over the prompt, saw 15 tok/s against 23, and stopped drafting that gained ~8% when left to the cost model;
* `measured` (Serve's default): per batch-size bucket (1, 2, 3-4, 5-8, ...), the batch's committed tokens per second
  over drafted steps and over undrafted ones, each over its last few steps on the live traffic; the faster one runs,
  and every `probe_every`-th step of a bucket runs the other, so a change in the traffic (a head that stops matching,
  longer contexts) is seen. A probe that confirms the choice doubles the bucket's interval (up to `max_probe_every`),
  one that overturns it resets the interval. When a bucket's choice changes, the kind it left starts a new window and
  is probed again within `RECHECK_EVERY` steps: its last steps may have been slow for a moment only (a server resumed
  from a pause), while the other kind's rate is as old as its last probe. A bucket with no measurement of its own
  follows its neighbours (drafting that lost at a smaller batch loses at a larger one; drafting that won at a larger
  batch wins at a smaller one) while its probes measure it; with none to follow it runs the two kinds in turn,
  `warmup` steps each, or fewer when one kind is `CLEAR_MARGIN` times faster than the other. A step the gate
  cannot time (a request joins it: its prefill is most of the step) runs the bucket's known winner, undrafted
  when none is known, and is neither a warm-up step nor a probe: what it would measure is lost. Serve admits one
  prompt a step under its prefill budget, so a closed loop of 16 ramps up through 15 join steps, one at each
  batch size, in buckets not yet measured: all 15 drafted, at 159 ms a step against 124 ms for the undrafted join
  steps of 15 sequences that followed (bf16, AMD EPYC, the interop config's math head, ad hoc). Why both economies:
  on a CPU a drafted step at batch 16 cost about three to five undrafted ones, so a drafting model lost ~6% to
  probes every 32nd step and ~18% to three drafted warm-up steps in each bucket the batch grew through. The
  anchors: vLLM's dynamic speculative decoding (speculation off above a batch size, decided from measured goodput)
  and TensorRT-LLM's draft length by batch size.

Lossless either way: an undrafted step verifies each sequence's root, and a paused proposer is handed every
position it missed when drafting resumes (`step.decode_step`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 5  # the steps of one kind a bucket's rate is taken over (the slowest left out)
WARMUP = 3  # steps of each kind a bucket measures before it chooses
PROBE_EVERY = 32  # a bucket runs the losing kind once every this many steps at first
CLEAR_MARGIN = 2.0  # one kind this many times faster than the other settles a bucket before its warm-up ends
MAX_PROBE_EVERY = 256  # ... and at most this rarely, once probes keep confirming the choice
RECHECK_EVERY = 4  # after a bucket's choice changes, the kind it left is probed this soon (then backing off)


def bucket(batch: int) -> int:
    """Batch-size bucket: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ... (step costs grow smoothly in between)."""
    return (batch - 1).bit_length()


def bucket_label(key: int) -> str:
    """The batch sizes of a bucket, as a metric label: "1", "2", "3-4", "5-8", ..."""
    return str(1 << key) if key < 2 else f"{(1 << (key - 1)) + 1}-{1 << key}"


@dataclass
class StepRate:
    """Committed tokens per second of one kind of step in one bucket, over its last `WINDOW` steps with the
    slowest left out once there are three. Why not a running average: one stalled step (a garbage collection, the
    OS taking a core) weighs in for as long as it takes later steps to dilute it, and in a losing bucket those
    come only from probes, ever rarer. At 1 in flight (fp32, an ad-hoc run) slow undrafted steps pushed that
    average from ~40 to 199 ms, so drafting (47 ms a token) looked faster, and it ran for 104 steps."""

    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (seconds, tokens) per step
    steps: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.recent.append((seconds, tokens))
        self.steps += 1

    @property
    def tokens_per_s(self) -> float:
        kept = sorted(tuple(self.recent))  # a snapshot: the metrics read it from the event loop's thread
        kept = kept[:-1] if len(kept) >= 3 else kept
        seconds = sum(s for s, _ in kept)
        return sum(t for _, t in kept) / seconds if seconds > 0 else 0.0


@dataclass
class DraftGate:
    """Decides, step by step, whether the batch drafts; `observe` feeds the measured rule."""

    draft_below: int | None = None
    measured: bool = False
    warmup: int = WARMUP
    probe_every: int = PROBE_EVERY
    max_probe_every: int = MAX_PROBE_EVERY
    rates: dict[tuple[int, bool], StepRate] = field(default_factory=dict)  # (bucket, drafted) -> rate
    decided: dict[int, int] = field(default_factory=dict)  # steps each bucket has chosen by its rates since a probe
    intervals: dict[int, int] = field(default_factory=dict)  # each bucket's probe interval (probe_every at first)
    probing: dict[int, bool] = field(default_factory=dict)  # bucket -> the winner its pending probe runs against

    def __post_init__(self) -> None:
        if self.draft_below is not None and self.draft_below < 1:
            raise ValueError(f"draft_below must be at least 1 (or None to always draft), got {self.draft_below}")
        if self.warmup < 1 or not 2 <= self.probe_every <= self.max_probe_every:
            raise ValueError(f"warmup must be at least 1 and probe_every at least 2 and at most max_probe_every, got "
                             f"{self.warmup}, {self.probe_every}, {self.max_probe_every}")

    def drafts(self, batch: int, self_timed: bool = False, timed: bool = True) -> bool:
        """Whether a step over `batch` live sequences drafts; `self_timed`: their proposers time themselves;
        `timed`: the step will be `observe`d (False: a request joins it), else it runs the known winner only."""
        if self.draft_below is not None and batch >= self.draft_below:
            return False
        if not self.measured or self._left_to_proposer(batch, self_timed):
            return True
        key = bucket(batch)
        winner = self.winner(key)
        if not timed:
            return winner is True
        if winner is None:  # nothing known here or nearby: the two kinds in turn, drafted first
            return self.rates.get((key, True), StepRate()).steps <= self.rates.get((key, False), StepRate()).steps
        self.decided[key] = self.decided.get(key, 0) + 1
        if self.decided[key] < self.intervals.get(key, self.probe_every):
            return winner
        self.decided[key] = 0
        self.probing[key] = winner
        return not winner

    def winner(self, key: int) -> bool | None:
        """Whether drafting is the faster kind in bucket `key` (None: not known). Measured there once both kinds
        have `warmup` steps (or one kind is `CLEAR_MARGIN` times faster); until then taken from the other buckets,
        since a larger batch is more compute-bound: drafting that lost at a smaller batch loses here, drafting
        that won at a larger one wins here."""
        own = self._measured(key)
        if own is not None:
            return own
        known = {other: self._measured(other) for other, _ in self.rates}
        if any(won is False for other, won in known.items() if other < key):
            return False
        if any(won is True for other, won in known.items() if other > key):
            return True
        return None

    def _measured(self, key: int) -> bool | None:
        drafted, plain = self.rates.get((key, True)), self.rates.get((key, False))
        if drafted is None or plain is None:
            return None
        rates = sorted((drafted.tokens_per_s, plain.tokens_per_s))
        if min(drafted.steps, plain.steps) < self.warmup and rates[1] < CLEAR_MARGIN * rates[0]:
            return None
        return drafted.tokens_per_s >= plain.tokens_per_s

    @staticmethod
    def _left_to_proposer(batch: int, self_timed: bool) -> bool:
        """A lone sequence's self-timing proposer decides by itself (not measured here either)."""
        return batch == 1 and self_timed

    def observe(self, batch: int, drafted: bool, seconds: float, tokens: int, self_timed: bool = False) -> None:
        """A finished step: `tokens` committed over the batch in `seconds` (drafting, verification, commit)."""
        if not self.measured or seconds <= 0 or self._left_to_proposer(batch, self_timed):
            return
        key = bucket(batch)
        before = self._measured(key)
        self.rates.setdefault((key, drafted), StepRate()).add(seconds, tokens)
        if key in self.probing and drafted != self.probing[key]:  # the probe's step: did it overturn the choice?
            confirmed = self.winner(key) == self.probing.pop(key)
            interval = self.intervals.get(key, self.probe_every)
            self.intervals[key] = min(2 * interval, self.max_probe_every) if confirmed else self.probe_every
        after = self._measured(key)
        if None not in (before, after) and before != after:
            self._measure_again(key, before)

    def _measure_again(self, key: int, demoted: bool) -> None:
        """Bucket `key` left the kind `demoted` because that kind's recent steps were slower. They may have been
        slow for a while only (a core taken away, a server resumed from a pause), while the other kind's rate is as
        old as its last probe; its window then held the slow steps until probes, backed off to up to
        `max_probe_every` steps apart, replaced them. So its window restarts, and it is probed again soon."""
        self.rates[(key, demoted)].recent.clear()
        self.intervals[key], self.decided[key] = min(RECHECK_EVERY, self.probe_every), 0
