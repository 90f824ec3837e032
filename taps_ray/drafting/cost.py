"""Per-sequence cost model (docs/algorithms.md#cost-model): `auto-<name>` verifies only what is expected to pay.

A step's verification costs about a for a root-only tree and a + j + b·k for a tree of k drafted nodes (j: what
any tree adds, such as a wider forward and a tree mask; b: each node). It commits 1 + (accepted drafts) tokens,
in expectation 1 + κ·E_k: E_k is the sum of the path confidences of the k nodes (each node's chance of
acceptance, if the proposer were calibrated) and κ the sequence's calibration, the drafts it got accepted over what their confidences promised. The wrapper measures
a, j, b, κ and the draft time d per sequence from its own calls: the time from `propose` returning to the loop's
`observe` of that step is the step's verification (target forward, acceptance, commit, the batch's other drafts),
the call itself its draft, and the feedback's tokens are what the step committed. Steps the loop ran without
drafting (its `DraftGate` paused the batch) reach neither call, so they are not taken for this sequence's steps.

Each drafted step keeps the k most confident nodes that minimise the expected cost per token of verification,
cost(k) / (1 + κ·E_k), so a shaky tree shrinks (to its root, when no tree pays for itself). Once the step is
measured, drafting is judged as a whole: the running average of (d + cost(k)) over that of (1 + κ·E_k),
against a plain step's a. When it loses, drafting pauses for `pause` root-only steps (8 at first, doubling up to
64 while probes keep losing), then one drafted step probes, its tree shrunk as if κ were 1 (a low κ would shrink
every tree to nothing, and κ could never recover; a tree that would not pay even then is not worth measuring);
a probe that pays resumes drafting and resets the pause. The first step is plain (it
measures a). j and b are a decayed least-squares fit over the drafted steps' sizes and times (`TreeCost`), b pulled
towards NODE_COST_GUESS · a, so it comes from the data only as far as the sizes vary; before the first drafted
step is measured, j is 0.

Lossless: the verified tree is a subtree of what the proposer drafted, and the inner proposer is handed every
committed position it missed when drafting resumes (as `run_loop`'s draft_below).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from taps_ray.drafting.names import AUTO_PREFIX
from taps_ray.drafting.proposer import NOT_DRAFTED, Feedback, Proposer, join_pending
from taps_ray.drafting.tree import DraftTree, path_scores, ranked_nodes, root_only, subtree

SMOOTHING = 0.5  # weight of the newest step in a running cost
DECAY = 0.7  # per drafted step measured, the weight left to older ones (κ's record, the tree-cost fit)
PRIOR = 0.5  # κ's prior: this many promised tokens, all accepted (κ starts at 1: trust the confidences)
NODE_COST_GUESS = 0.02  # b / a that the fit is pulled towards (one node of a tree costs little once a tree is paid for)
GUESS_WEIGHT = 1.0  # how strongly: as much as size variance 1 over one measured step
MARGIN = 1.0  # drafting must cost at most this times the plain cost per token
MIN_PAUSE, MAX_PAUSE = 8, 64  # root-only steps between probes: the first pause, and the most after doubling


@dataclass(frozen=True)
class TreeCost:
    """What verifying a drafted tree costs beyond a root-only step, fitted as j + b·k over the drafted steps: a
    least-squares fit with older steps decayed, and b pulled towards a guess (ridge), so that steps of one size
    (no information on the slope) put all of the cost in j."""

    sums: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0)  # decayed Σ1, Σk, Σk², Σy, Σk·y (y: seconds beyond a)

    def add(self, kept: int, extra_s: float) -> TreeCost:
        n, sk, skk, sy, sky = (DECAY * v for v in self.sums)
        return TreeCost((n + 1, sk + kept, skk + kept * kept, sy + extra_s, sky + kept * extra_s))

    def fit(self, guess: float) -> tuple[float, float]:
        """(j, b), both at least 0; (0, guess) before any drafted step."""
        n, sk, skk, sy, sky = self.sums
        if n == 0:
            return 0.0, guess
        spread = skk - sk * sk / n
        per_node = max((sky - sk * sy / n + GUESS_WEIGHT * guess) / (spread + GUESS_WEIGHT), 0.0)
        return max((sy - per_node * sk) / n, 0.0), per_node


@dataclass(frozen=True)
class CostState:
    inner: Any  # the wrapped proposer's state
    pending: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # committed (features, next tokens) it has not seen
    returned_at: float = 0.0  # clock when the last `propose` returned
    kept: int = 0  # drafted nodes in the last verified tree
    promised: float = 0.0  # their summed confidence (E_k)
    plain_s: float | None = None  # a: running seconds of a root-only step
    tree_cost: TreeCost = TreeCost()  # j and b
    draft_s: float | None = None  # d: seconds the last step drafted (None: it did not)
    outlook: tuple[float, float] | None = None  # running expected (seconds, tokens) of a drafted step
    record: tuple[float, float] = (0.0, 0.0)  # decayed sums behind κ: (drafts accepted, confidence promised)
    pause: int = 0  # length of the current (or last) pause
    paused_left: int = 0  # root-only steps left before the next probe
    last_head: int = NOT_DRAFTED  # what the loop records as the step's head

    @property
    def calibration(self) -> float:
        """κ: accepted drafts per unit of promised confidence, lately."""
        accepted, promised = self.record
        return (accepted + PRIOR) / (promised + PRIOR)

    def verify_cost(self, kept: int) -> float:
        """Expected seconds to verify a tree of `kept` drafted nodes."""
        if kept == 0:
            return self.plain_s
        jump, per_node = self.tree_cost.fit(NODE_COST_GUESS * self.plain_s)
        return self.plain_s + jump + per_node * kept


def _running(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


def best_size(scores: list[float], verify_cost: Callable[[int], float], calibration: float) -> int:
    """The k minimising verify_cost(k) / (1 + κ·E_k) over the most confident k of `scores` (sorted, highest first)."""
    best, best_cost, promised = 0, verify_cost(0), 0.0
    for k, score in enumerate(scores, start=1):
        promised += score
        cost = verify_cost(k) / (1 + calibration * promised)
        if cost < best_cost:
            best, best_cost = k, cost
    return best


@dataclass
class CostAware(Proposer):
    """Wraps any proposer; per sequence, verifies the part of each tree that pays, and drafts only while it pays."""

    inner: Proposer
    name: str = ""
    clock: Callable[[], float] = time.perf_counter
    margin: float = MARGIN
    times_itself: ClassVar[bool] = True
    replay_refusal: ClassVar[str] = ("decides from measured step times, which a replay does not have: run it live "
                                     "(eval.replay leaves auto-* cells live)")

    def __post_init__(self) -> None:
        self.name = self.name or f"{AUTO_PREFIX}{self.inner.name}"

    @property
    def head_names(self) -> list[str]:
        return self.inner.head_names

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.inner.feature_layers

    @property
    def reads_features(self) -> bool:
        return self.inner.reads_features

    def init_state(self) -> CostState:
        return CostState(inner=self.inner.init_state())

    def map_heads(self, swap: Callable[[Proposer], Proposer]) -> Proposer:
        """The wrapped proposer with its heads swapped (online adaptation swaps a head inside a served router)."""
        return replace(self, inner=self.inner.map_heads(swap))

    def with_part(self, part: Proposer) -> Proposer:
        return replace(self, inner=self.inner.with_part(part))

    def head_of(self, state: CostState) -> int:
        return state.last_head

    def propose(self, state: CostState, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, CostState]:
        (tree,), (state,) = self.propose_batch([state], [features], [next_tokens])
        return tree, state

    def propose_batch(self, states: list[CostState], features: list[torch.Tensor], next_tokens: list[torch.Tensor]
                      ) -> tuple[list[DraftTree], list[CostState]]:
        """Each sequence's step: a paused one verifies its root, the drafting ones draft in ONE `propose_batch` of
        the wrapped proposer (one draft pass over the batch, as it runs unwrapped). One by one (the base class's
        loop), Serve's engine drafting every step ran the interop config's `math` at 147.5 against 164.3 tok/s at
        16 in flight and 121.6 against 127.6 at 4 (bf16, AMD EPYC, draft_gate.py). Every sequence's draft time is
        the batch's: its step waits for all of it."""
        now = self.clock()
        states = [replace(s, pending=(*s.pending, (f, t)))
                  for s, f, t in zip(states, features, next_tokens, strict=True)]
        drafting = [i for i, s in enumerate(states) if s.plain_s is not None and s.paused_left == 0]
        drafted: dict[int, tuple[DraftTree, Any]] = {}
        if drafting:
            joined = [join_pending(states[i].pending) for i in drafting]
            trees, inners = self.inner.propose_batch([states[i].inner for i in drafting], [f for f, _ in joined],
                                                     [t for _, t in joined])
            drafted = dict(zip(drafting, zip(trees, inners, strict=True), strict=True))
        done = self.clock()
        out = [self._kept(state, *drafted[i], done - now, done) if i in drafted else self._root(state, tokens, done)
               for i, (state, tokens) in enumerate(zip(states, next_tokens, strict=True))]
        return [tree for tree, _ in out], [state for _, state in out]

    @staticmethod
    def _root(state: CostState, next_tokens: torch.Tensor, done: float) -> tuple[DraftTree, CostState]:
        """A root-only step (the plain first step, or a step of a pause, which it counts down)."""
        return root_only(int(next_tokens[-1]), next_tokens.device), replace(
            state, kept=0, promised=0.0, draft_s=None, paused_left=max(state.paused_left - 1, 0), returned_at=done,
            last_head=NOT_DRAFTED)

    def _kept(self, state: CostState, drafted: DraftTree, inner: Any, draft_s: float, done: float
              ) -> tuple[DraftTree, CostState]:
        """The part of a drafted tree that pays (`best_size`), and the state that remembers what it promised."""
        order, scores = ranked_nodes(drafted), path_scores(drafted)
        ranked = [scores[j] for j in order]
        probe = state.pause > 0  # the drafted step after a pause trusts the confidences (κ = 1): it measures κ
        kept = best_size(ranked, state.verify_cost, 1.0 if probe else state.calibration)
        tree = drafted if kept == len(order) else subtree(drafted, order[:kept])
        return tree, replace(state, inner=inner, pending=(), kept=kept, promised=sum(ranked[:kept]),
                             draft_s=draft_s, returned_at=done,
                             last_head=self.inner.head_of(inner) if kept else NOT_DRAFTED)

    def observe(self, states: list[CostState], feedback: list[Feedback]) -> list[CostState]:
        """Measure the step each state proposed for (its verification time and committed tokens); then the inner
        proposer hears what was accepted of the trees it drafted (verified beyond the root), so a router that
        learns from verification keeps learning under the cost model. Root-only steps, paused or pruned to
        nothing, are not its trees."""
        now = self.clock()
        out = [self._measure(state, now, len(f.tokens)) for state, f in zip(states, feedback, strict=True)]
        drafted = [i for i, state in enumerate(out) if state.kept > 0]
        if not drafted:
            return out
        inner = self.inner.observe([out[i].inner for i in drafted], [feedback[i] for i in drafted])
        for i, state in zip(drafted, inner, strict=True):
            out[i] = replace(out[i], inner=state)
        return out

    def _measure(self, state: CostState, now: float, committed: int) -> CostState:
        """Fold the last step into a (root-only verification) or j, b and κ (a drafted tree); after a drafted step,
        judge drafting on its running outlook and pause if it loses. The outlook is each drafted step's expected
        cost and tokens, so one low-confidence tree (verified as its root) weighs in without pausing a head that
        pays on most steps."""
        verify_s = now - state.returned_at
        if state.kept == 0:
            state = replace(state, plain_s=_running(state.plain_s, verify_s))
        else:
            accepted, promised = state.record
            state = replace(
                state,
                tree_cost=state.tree_cost.add(state.kept, verify_s - state.plain_s),
                record=(DECAY * accepted + committed - 1, DECAY * promised + state.promised),
            )
        if state.draft_s is None:
            return state
        step = (state.draft_s + state.verify_cost(state.kept), 1 + state.calibration * state.promised)
        seconds, tokens = step if state.outlook is None else (_running(o, n) for o, n in zip(state.outlook, step))
        if seconds / tokens > self.margin * state.plain_s:
            return self._pause(state)
        return replace(state, outlook=(seconds, tokens), pause=0)

    @staticmethod
    def _pause(state: CostState) -> CostState:
        """Pause drafting; the outlook is forgotten, so the probe after the pause is judged on its own."""
        pause = min(max(2 * state.pause, MIN_PAUSE), MAX_PAUSE)
        return replace(state, outlook=None, pause=pause, paused_left=pause)
