"""Per-sequence cost model (docs/algorithms.md#cost-model): `auto-<name>` verifies only what is expected to pay.

A step's verification costs about a + b·k for a tree of k drafted nodes (a: a root-only step, b: each drafted
node), and it commits 1 + (accepted drafts) tokens, in expectation 1 + κ·E_k: E_k is the sum of the path
confidences of the k nodes (each node's chance of acceptance, if the proposer were calibrated) and κ the
sequence's calibration, the drafts it got accepted over what their confidences promised. The wrapper measures
a, b, κ and the draft time d per sequence from its own calls: the time from one `propose` returning to the next
being called is that step's verification (target forward, acceptance, commit, the batch's other drafts), the
call itself its draft, and the length of the next `next_tokens` is what the step committed.

Each drafted step keeps the k most confident nodes that minimise the expected cost per token,
(a + b·k) / (1 + κ·E_k), so a shaky tree shrinks (to its root, when no node pays for itself). Once the step is
measured, drafting is judged as a whole: (d + a + b·k) / (1 + κ·E_k) against a plain step's a. When it loses,
drafting pauses for `pause` root-only steps (4 at first, doubling up to 64 while probes keep losing), then one
drafted step probes; a probe that pays resumes drafting and resets the pause. The first step is plain (it
measures a); until a drafted step is measured, b is NODE_COST_GUESS · a.

Lossless: the verified tree is a subtree of what the proposer drafted, and the inner proposer is handed every
committed position it missed when drafting resumes (as `run_loop`'s draft_below).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from taps_ray.engine.generate import NOT_DRAFTED
from taps_ray.engine.proposers import Proposer
from taps_ray.engine.tree import DraftTree, path_scores, ranked_nodes, root_only, subtree

SMOOTHING = 0.5  # weight of the newest step in a running cost
DECAY = 0.7  # per measured step, how much of the older acceptance record counts towards κ
PRIOR = 1.0  # κ's prior: this many promised tokens, all accepted (κ starts at 1: trust the confidences)
NODE_COST_GUESS = 0.05  # b / a before any drafted step is measured (a CPU forward: ~0.03-0.08 per extra token)
MARGIN = 1.0  # drafting must cost at most this times the plain cost per token
MIN_PAUSE, MAX_PAUSE = 4, 64  # root-only steps between probes: the first pause, and the most after doubling


@dataclass(frozen=True)
class CostState:
    inner: Any  # the wrapped proposer's state
    pending: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # committed (features, next tokens) it has not seen
    steps: int = 0  # calls so far
    returned_at: float = 0.0  # clock when the last `propose` returned
    kept: int = 0  # drafted nodes in the last verified tree
    promised: float = 0.0  # their summed confidence (E_k)
    plain_s: float | None = None  # a: running seconds of a root-only step
    node_s: tuple[float, float] = (0.0, 0.0)  # decayed sums behind b: (seconds beyond a, drafted nodes verified)
    draft_cost: float | None = None  # d: running seconds of a draft
    record: tuple[float, float] = (0.0, 0.0)  # decayed sums behind κ: (drafts accepted, confidence promised)
    pause: int = 0  # length of the current (or last) pause
    paused_left: int = 0  # root-only steps left before the next probe
    last_head: int = NOT_DRAFTED  # what the loop records as the step's head

    @property
    def calibration(self) -> float:
        """κ: accepted drafts per unit of promised confidence, lately."""
        accepted, promised = self.record
        return (accepted + PRIOR) / (promised + PRIOR)

    @property
    def node_cost(self) -> float:
        """b: seconds each drafted node adds to a verification (the guess counts as one measured node)."""
        extra, nodes = self.node_s
        return (extra + NODE_COST_GUESS * (self.plain_s or 0.0)) / (nodes + 1)


def _running(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


def best_size(scores: list[float], plain_s: float, node_s: float, calibration: float) -> int:
    """The k minimising (a + b·k) / (1 + κ·E_k) over the most confident k of `scores` (sorted, highest first)."""
    best, best_cost, promised = 0, plain_s, 0.0
    for k, score in enumerate(scores, start=1):
        promised += score
        cost = (plain_s + node_s * k) / (1 + calibration * promised)
        if cost < best_cost:
            best, best_cost = k, cost
    return best


@dataclass
class CostAware:
    """Wraps any proposer; per sequence, verifies the part of each tree that pays, and drafts only while it pays."""

    inner: Proposer
    name: str = ""
    clock: Callable[[], float] = time.perf_counter
    margin: float = MARGIN

    def __post_init__(self) -> None:
        self.name = self.name or f"auto-{self.inner.name}"

    @property
    def head_names(self) -> list[str]:
        return self.inner.head_names

    def init_state(self) -> CostState:
        return CostState(inner=self.inner.init_state())

    def propose(self, state: CostState, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, CostState]:
        now = self.clock()
        state = self._measure(state, now, int(next_tokens.numel()))
        state = replace(state, pending=(*state.pending, (features, next_tokens)), steps=state.steps + 1)
        if state.plain_s is None or state.paused_left > 0:
            tree = root_only(int(next_tokens[-1]), next_tokens.device)
            return tree, replace(state, kept=0, promised=0.0, paused_left=max(state.paused_left - 1, 0),
                                 returned_at=self.clock(), last_head=NOT_DRAFTED)
        all_features = torch.cat([f for f, _ in state.pending])
        all_tokens = torch.cat([t for _, t in state.pending])
        drafted, inner = self.inner.propose(state.inner, all_features, all_tokens)
        order, scores = ranked_nodes(drafted), path_scores(drafted)
        ranked = [scores[j] for j in order]
        kept = best_size(ranked, state.plain_s, state.node_cost, state.calibration)
        tree = drafted if kept == len(order) else subtree(drafted, order[:kept])
        done = self.clock()
        state = replace(state, inner=inner, pending=(), kept=kept, promised=sum(ranked[:kept]),
                        draft_cost=_running(state.draft_cost, done - now),
                        returned_at=done, last_head=getattr(inner, "last_head", 0) if kept else NOT_DRAFTED)
        if not kept:  # nothing drafted pays for its verification: a losing step, known before verifying
            state = self._pause(state)
        return tree, state

    def _measure(self, state: CostState, now: float, committed: int) -> CostState:
        """Fold the last step into the running costs and κ; after a drafted step, judge drafting and pause if it
        lost. The first call's tokens are the prompt's: there is no step to measure."""
        if state.steps == 0:
            return state
        verify_s = now - state.returned_at
        if state.kept == 0:
            return replace(state, plain_s=_running(state.plain_s, verify_s))
        extra, nodes = state.node_s
        accepted, promised = state.record
        state = replace(
            state,
            node_s=(DECAY * extra + max(verify_s - state.plain_s, 0.0), DECAY * nodes + state.kept),
            record=(DECAY * accepted + committed - 1, DECAY * promised + state.promised),
        )
        expected_tokens = 1 + state.calibration * state.promised
        drafting = ((state.draft_cost or 0.0) + state.plain_s + state.node_cost * state.kept) / expected_tokens
        if drafting > self.margin * state.plain_s:
            return self._pause(state)
        return replace(state, pause=0)

    @staticmethod
    def _pause(state: CostState) -> CostState:
        pause = min(max(2 * state.pause, MIN_PAUSE), MAX_PAUSE)
        return replace(state, pause=pause, paused_left=pause)
