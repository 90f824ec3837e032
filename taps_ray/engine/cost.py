"""Per-sequence cost model (docs/algorithms.md#cost-model): `auto-<name>` drafts only while drafting pays.

Speculation pays when a drafted step's cost per committed token (draft + verification of the tree, over the
accepted tokens + 1) is below a plain step's cost per token. Both depend on the prompt (acceptance), the
tree, the machine and the batch, so the wrapper measures them per sequence, from its own calls: the time
from one `propose` returning to the next being called is that step's verification (target forward,
acceptance, commit, the batch's other drafts), the call itself is its draft, and the length of the next
`next_tokens` is what the step committed. Running costs (exponential averages) are kept for drafted steps
and for root-only steps, which are plain decoding steps.

Policy: the first step of a sequence is a plain one (the baseline); then it drafts. When a drafted step
costs more per token than `margin` x the plain cost, drafting pauses for `pause` steps (root-only trees),
then one drafted step probes again: a probe that does not pay doubles the pause (up to `max_pause`), one
that pays resumes drafting and resets it. Lossless: only the verified tree's size changes, and the inner
proposer is handed every committed position it missed when drafting resumes (as `run_loop`'s draft_below).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from taps_ray.engine.generate import NOT_DRAFTED
from taps_ray.engine.proposers import Proposer
from taps_ray.engine.tree import DraftTree, root_only
SMOOTHING = 0.5  # weight of the newest step in a running cost
MARGIN = 1.0  # drafting must cost at most this times the plain cost per token
MIN_PAUSE, MAX_PAUSE = 4, 64  # root-only steps between probes: the first pause, and the most after doubling


@dataclass(frozen=True)
class CostState:
    inner: Any  # the wrapped proposer's state
    pending: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # committed (features, next tokens) it has not seen
    steps: int = 0  # calls so far
    drafted: bool = False  # whether the last step verified a drafted tree
    returned_at: float = 0.0  # clock when the last `propose` returned
    draft_s: float = 0.0  # how long the last `propose` drafted
    spec_cost: float | None = None  # running seconds per committed token of drafted steps
    plain_cost: float | None = None  # running seconds per committed token of root-only steps
    pause: int = 0  # length of the current (or last) pause
    paused_left: int = 0  # root-only steps left before the next probe
    last_head: int = NOT_DRAFTED  # what the loop records as the step's head


def _running(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


@dataclass
class CostAware:
    """Wraps any proposer; per sequence, drafts only while a drafted step costs less per token than a plain one."""

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
        if not self._draft_now(state):
            tree = root_only(int(next_tokens[-1]), next_tokens.device)
            left = max(state.paused_left - 1, 0)
            return tree, replace(state, drafted=False, draft_s=0.0, paused_left=left, returned_at=self.clock(),
                                 last_head=NOT_DRAFTED)
        all_features = torch.cat([f for f, _ in state.pending])
        all_tokens = torch.cat([t for _, t in state.pending])
        tree, inner = self.inner.propose(state.inner, all_features, all_tokens)
        done = self.clock()
        return tree, replace(state, inner=inner, pending=(), drafted=True, draft_s=done - now, returned_at=done,
                             last_head=getattr(inner, "last_head", 0))

    def _measure(self, state: CostState, now: float, committed: int) -> CostState:
        """Fold the last step's cost per committed token into its kind's running cost; pause if drafting lost.

        A pause forgets the drafted cost, so the probe after it is judged on its own measurement."""
        if state.steps == 0:  # the first call's tokens are the prompt's: no step to measure
            return state
        per_token = (now - state.returned_at + state.draft_s) / max(committed, 1)
        if not state.drafted:
            return replace(state, plain_cost=_running(state.plain_cost, per_token))
        spec_cost = _running(state.spec_cost, per_token)
        if spec_cost > self.margin * state.plain_cost:
            pause = min(max(2 * state.pause, MIN_PAUSE), MAX_PAUSE)
            return replace(state, spec_cost=None, pause=pause, paused_left=pause)
        return replace(state, spec_cost=spec_cost, pause=0)

    @staticmethod
    def _draft_now(state: CostState) -> bool:
        return state.plain_cost is not None and state.paused_left == 0
