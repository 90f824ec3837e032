"""Exact replay of greedy (T = 0) speculative decoding from one recorded target continuation.

At temperature 0 the tokens a step accepts depend only on the target's greedy continuation: greedy acceptance
walks the tree along the tokens the target would emit. So the target decodes each prompt once (plain, batched),
one forward over prompt + continuation gives the features the live loop would hand a proposer, and every
proposer is then replayed against that record without running the target again: `record_traces` once per
prompt, `replay` once per proposer. The heads draft every tree the replay can reach in a few batched forwards
(decoding/replay_draft.py) instead of one draft pass per step. Replay then runs the live loop itself (`run_loop`,
so `step.decode_step`) over a `TraceVerifier` that answers each step from the record: the step records are the
live loop's by construction, except that neither a per-step draft pass nor verification ran: `draft_s`, `verify_s`
and `wall_s` are NaN (speed is measured by live cells only).

Exactness: in exact arithmetic replay equals the live loop. In floating point the features of one long forward
and of the live loop's tree forwards (and a head's batched draft and its per-step one) differ in the last bits, so
a near-tie in a draft head's top-k (or in the target's argmax, which the live loop takes from a tree forward) can
flip; tests count such cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F

from taps_ray.decoding.generate import run_loop
from taps_ray.decoding.replay_draft import TraceTrees, TreeMemo, replay_drafters
from taps_ray.decoding.step import Generation, Verifier
from taps_ray.decoding.target_batch import Committed
from taps_ray.decoding.verify import POINT_MASS, AcceptanceRule, SamplingParams, Verdict
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.tree import DraftTree, pad_trees, root_only
from taps_ray.syncs import to_device

GREEDY = SamplingParams()
NO_TOKEN = -1  # past the recorded continuation: matches no drafted token


@dataclass
class GreedyTrace:
    """One prompt's greedy continuation, `lookahead` tokens past where decoding stops, and the target's post-norm
    features of prompt + continuation from one forward ([len(prompt) + len(tokens), d])."""

    prompt: list[int]
    tokens: list[int]
    features: torch.Tensor
    lookahead: int
    # the heads' trees along this trace, drafted once for every proposer replayed on it
    drafted: TreeMemo = field(default_factory=WeakKeyDictionary, repr=False, compare=False)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def moved(trace: GreedyTrace, device: torch.device | str) -> GreedyTrace:
    """The trace with its features and drafted trees on `device` (`eval.traces_on_host` keeps a benchmark's traces
    on the CPU and moves one replay batch at a time to the drafter's device: a whole benchmark's features and trees
    would not fit beside the heads)."""
    drafted: TreeMemo = WeakKeyDictionary(
        {head: {key: _trees_to(trees, device) for key, trees in memo.items()} for head, memo in trace.drafted.items()})
    return GreedyTrace(trace.prompt, trace.tokens, trace.features.to(device), trace.lookahead, drafted)


def _trees_to(trees: TraceTrees, device: torch.device | str) -> TraceTrees:
    return replace(trees, tokens=trees.tokens.to(device), parents=trees.parents.to(device),
                   confidence=trees.confidence.to(device), entropy=trees.entropy.to(device))


def _end(tokens: list[int], budget: int, stops: set[int]) -> int:
    """How many of `tokens` the live loop keeps: up to the first stop token or `budget` (the budget while
    neither is reached, so decoding goes on)."""
    for i, token in enumerate(tokens[:budget]):
        if token in stops:
            return i + 1
    return budget


@torch.no_grad()
def record_traces(
    make_verifier: Callable[[], Verifier],
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    lookahead: int,
    continuations: list[list[int]] | None = None,
) -> list[GreedyTrace]:
    """Greedy-decode every prompt (one batched target forward per token) until `lookahead` tokens past its end
    (stop token or `max_new_tokens`), then one batched forward over each prompt + continuation for the features.

    `lookahead` must cover the deepest drafted node (a tree of depth D reads up to D tokens past the last kept
    one); `replay` raises when a tree reaches past the record. `continuations`: the greedy tokens already
    recorded with the same budget and lookahead (for another feature kind of the same verifier's model): only the
    features forward runs.
    """
    seeds = [0] * len(prompts)
    if continuations is not None:
        return _traced(make_verifier, prompts, continuations, seeds, lookahead)
    stops = set(stop_ids)
    verifier = make_verifier()
    started = verifier.start(prompts, GREEDY, seeds)
    tokens = [c.tokens for c in started]
    device = started[0].next_tokens.device  # the verifier's: trees are built where it verifies

    def tree(b: int):
        done = len(tokens[b]) >= _end(tokens[b], max_new_tokens, stops) + lookahead
        return None if done else root_only(tokens[b][-1], device)

    trees = [tree(b) for b in range(len(prompts))]
    while any(t is not None for t in trees):
        for b, committed in enumerate(verifier.step(trees)):
            if committed is not None:
                tokens[b] = tokens[b] + committed.tokens
        trees = [tree(b) if trees[b] is not None else None for b in range(len(prompts))]
    return _traced(make_verifier, prompts, tokens, seeds, lookahead)


def _traced(make_verifier: Callable[[], Verifier], prompts: list[list[int]], tokens: list[list[int]],
            seeds: list[int], lookahead: int) -> list[GreedyTrace]:
    """The traces of greedy continuations: one batched forward over each prompt + continuation for the features."""
    full = [p + t for p, t in zip(prompts, tokens)]
    features = [c.features for c in make_verifier().start(full, GREEDY, seeds)]
    return [GreedyTrace(p, t, f, lookahead) for p, t, f in zip(prompts, tokens, features)]


@torch.no_grad()
def replay(proposer: Proposer, traces: list[GreedyTrace], max_new_tokens: int, stop_ids: list[int]) -> list[Generation]:
    """The generations `run_loop(verifier, proposer, prompts, greedy, max_new_tokens, stop_ids)` would produce,
    computed from the traces by that same loop: the proposer's heads draft the trees of every root position the
    replay can reach in batches (`replay_drafters`, one proposer per trace), and a `TraceVerifier` accepts each
    tree by walking it along the recorded continuation. No target ran and no draft pass ran per step, so the
    loop's clocks timed replay itself: `draft_s`, `verify_s`, `prefill_s` and `wall_s` are NaN."""
    stops = set(stop_ids)
    # a root sits at the prompt's end or after a kept token that did not finish the answer
    roots = [range(len(t.prompt), len(t.prompt) + _end(t.tokens, max_new_tokens, stops) - 1) for t in traces]
    drafters = replay_drafters(
        proposer, [t.sequence for t in traces], [t.features for t in traces], roots, [t.drafted for t in traces]
    )
    generations = run_loop(TraceVerifier(traces), drafters, [t.prompt for t in traces], GREEDY, max_new_tokens,
                           stop_ids)
    for generation in generations:
        generation.prefill_s = generation.wall_s = math.nan
        for step in generation.steps:
            step.draft_s = step.verify_s = math.nan
    return generations


class TraceVerifier:
    """The loop's `Verifier` for a replay: the target's answers read from greedy traces instead of computed.

    At T = 0 a tree's accepted path is the longest one along the target's greedy continuation, which the trace
    holds: the acceptance rule a `TargetBatch` applies (`AcceptanceRule.greedy_verdicts`) reads the recorded next
    token in place of the target's argmax. What a step commits is what a `TargetBatch` would hand back: the
    trace's features of the accepted positions and the recorded tokens after them (the last one the next root)."""

    def __init__(self, traces: list[GreedyTrace], acceptance: AcceptanceRule = POINT_MASS) -> None:
        self.traces, self.acceptance = traces, acceptance
        self.sequences = [torch.tensor(t.sequence, device=t.features.device) for t in traces]
        # every record in one tensor, NO_TOKEN after its end (a column more than the longest): a step reads the
        # recorded token after every node of every tree in one gather, no per-sequence loop
        longest = max((s.numel() for s in self.sequences), default=0) + 1
        self.records = torch.stack([F.pad(s, (0, longest - s.numel()), value=NO_TOKEN) for s in self.sequences]) \
            if traces else None
        self.lengths = [0] * len(traces)  # committed positions; a sequence's root (last output token) sits there

    def start(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Committed]:
        """The prefill: every prompt position committed, the trace's first token the first output."""
        if prompts != [t.prompt for t in self.traces] or not params.greedy:
            raise ValueError("a trace verifier replays greedy decoding (T = 0) of its own traces' prompts only")
        return [self._commit(b, len(t.prompt), t.tokens[:1]) for b, t in enumerate(self.traces)]

    def step(self, trees: list[DraftTree | None]) -> list[Committed | None]:
        """Every tree's verdict in one call of the acceptance rule, from the recorded token after each node."""
        live = [tree for tree in trees if tree is not None]
        if not live:
            return [None] * len(trees)
        padded = pad_trees(trees, max(tree.size for tree in live), live[0].tokens.device)
        lengths = to_device(self.lengths, padded.depth.device, torch.long)
        positions = (lengths[:, None] + 1 + padded.depth).clamp(max=self.records.shape[1] - 1)
        target_next = self.records.gather(1, positions)
        verdicts = self.acceptance.greedy_verdicts(padded, target_next)
        return [None if verdict is None else self._accept(b, verdict) for b, verdict in enumerate(verdicts)]

    def _accept(self, b: int, verdict: Verdict) -> Committed:
        if verdict.bonus == NO_TOKEN:
            raise ValueError(
                f"an accepted path of depth {len(verdict.nodes) - 1} reached past the recorded continuation; record "
                f"the traces with a larger lookahead (now {self.traces[b].lookahead})"
            )
        tokens = verdict.tokens[1:] + [verdict.bonus]
        return self._commit(b, self.lengths[b] + len(verdict.nodes), tokens, verdict)

    def _commit(self, b: int, length: int, tokens: list[int], verdict: Verdict | None = None) -> Committed:
        """Sequence b's positions up to `length` committed: their features and the recorded token after each."""
        done, self.lengths[b] = self.lengths[b], length
        features, next_tokens = self.traces[b].features[done:length], self.sequences[b][done + 1 : length + 1]
        return Committed(tokens=tokens, features=features, next_tokens=next_tokens, verdict=verdict)
