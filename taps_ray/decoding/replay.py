"""Exact replay of greedy (T = 0) speculative decoding from one recorded target continuation.

At temperature 0 the tokens a step accepts depend only on the target's greedy continuation: greedy acceptance
walks the tree along the tokens the target would emit. So the target decodes each prompt once (plain, batched),
one forward over prompt + continuation gives the features the live loop would hand a proposer, and every
proposer is then replayed against that record without running the target again: `record_traces` once per
prompt, `replay` once per proposer. The heads draft every tree the replay can reach in a few batched forwards
(decoding/replay_draft.py) instead of one draft pass per step. The step records are the live loop's (`run_loop`),
except that neither a per-step draft pass nor verification ran: `draft_s`, `verify_s` and `wall_s` are NaN
(speed is measured by live cells only).

Exactness: in exact arithmetic replay equals the live loop. In floating point the features of one long forward
and of the live loop's tree forwards (and a head's batched draft and its per-step one) differ in the last bits, so
a near-tie in a draft head's top-k (or in the target's argmax, which the live loop takes from a tree forward) can
flip; tests count such cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch

from taps_ray.decoding.draft_step import chosen_head
from taps_ray.decoding.generate import Generation, Verifier, extend_tokens, record_step, step_tokens
from taps_ray.decoding.replay_draft import TreeMemo, replay_drafters
from taps_ray.decoding.verify import SamplingParams, greedy_path
from taps_ray.drafting.proposers import Proposer
from taps_ray.drafting.tree import root_only

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
    computed from the traces: the proposer's heads draft the trees of every root position the replay can reach
    in batches (`replay_drafters`), the proposer is stepped as in the live loop, and each tree is accepted by
    walking it along the recorded continuation."""
    stops = set(stop_ids)
    # a root sits at the prompt's end or after a kept token that did not finish the answer
    roots = [range(len(t.prompt), len(t.prompt) + _end(t.tokens, max_new_tokens, stops) - 1) for t in traces]
    drafters = replay_drafters(
        proposer, [t.sequence for t in traces], [t.features for t in traces], roots, [t.drafted for t in traces]
    )
    return [_replay_one(d, trace, max_new_tokens, stops) for d, trace in zip(drafters, traces)]


def _recorded(sequence: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The recorded tokens at `positions`, NO_TOKEN past the end of the record."""
    inside = positions < sequence.numel()
    return torch.where(inside, sequence[positions.clamp(max=sequence.numel() - 1)], NO_TOKEN)


def _replay_one(proposer: Proposer, trace: GreedyTrace, max_new_tokens: int, stops: set[int]) -> Generation:
    sequence = torch.tensor(trace.sequence, device=trace.features.device)
    generation = Generation(prompt=list(trace.prompt), wall_s=math.nan)
    extend_tokens(generation, trace.tokens[:1], stops, max_new_tokens)
    state = proposer.init_state()
    length = len(trace.prompt)  # committed positions; the root (last emitted token) sits at `length`
    new = slice(0, length)
    while not generation.finished_by:
        tree, state = proposer.propose(state, trace.features[new], sequence[new.start + 1 : new.stop + 1])
        verdict = greedy_path(tree, _recorded(sequence, length + 1 + tree.depth))
        if verdict.bonus == NO_TOKEN:
            raise ValueError(
                f"a tree of depth {int(tree.depth.max())} reached past the recorded continuation; record the traces "
                f"with a larger lookahead (now {trace.lookahead})"
            )
        committed = verdict.tokens[1:] + [verdict.bonus]
        extend_tokens(generation, committed, stops, max_new_tokens)
        generation.steps.append(record_step(tree, verdict, step_tokens(committed, stops), math.nan, math.nan,
                                            chosen_head(state)))
        new = slice(length, length + len(verdict.nodes))
        length = new.stop
    return generation
