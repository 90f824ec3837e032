"""Prompt-lookup drafting (docs/algorithms.md#prompt-lookup): copy what followed the last n-gram earlier on.

No model and no draft pass: the draft is a chain copied from the prompt and the output so far (prompt lookup
decoding, HF's `prompt_lookup_num_tokens`), so it costs nothing to draft and pays where answers repeat their
question (numbers in GSM8K, names, code). The search tries n = max_ngram down to 1 and takes the most recent
earlier occurrence with a continuation (HF takes the earliest; the latest follows the output's own repeats).

Every drafted token is a point mass (its entropy is 0). Verification already treats every drafted token as a
point mass (docs/algorithms.md#acceptance), so the sampling rule stays exact for these nodes.

Calibrated confidence: per sequence, the state counts how often a drafted token was what the target produced
next, given that the tokens before it in the chain were (the committed text handed to the next `propose` is
compared with the last chain, whether or not the chain was verified in full). The rate
r = (hits + PRIOR_HITS) / (tries + PRIOR_TRIES) estimates P(token accepted | parent accepted), so the node at
depth d carries confidence r^d: a path-acceptance estimate on the same scale as an EAGLE head's cumulative
confidence, which lets a merged tree rank both kinds of node together (`combine.rank_merge`). The prior is a
weak 1 in 2: a sequence's own record outweighs it after a few steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.tree import DraftTree, build_tree
from taps_ray.syncs import to_device

MAX_NGRAM = 3
NUM_TOKENS = 10  # the chain length HF prompt lookup is benchmarked with here (`prompt_lookup_num_tokens`)
PRIOR_HITS, PRIOR_TRIES = 1.0, 2.0


def lookup(history: Sequence[int], max_ngram: int, num_tokens: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest matching suffix n-gram ([] if none)."""
    size = len(history)
    for n in range(min(max_ngram, size - 1), 0, -1):
        pattern = tuple(history[size - n :])
        last = pattern[-1]
        for start in range(size - n - 1, -1, -1):  # start + n < size: the occurrence has a continuation
            if history[start + n - 1] == last and tuple(history[start : start + n]) == pattern:
                return list(history[start + n : start + n + num_tokens])
    return []


def matched_prefix(chain: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(hits, tries): leading chain tokens equal to the committed ones, and how many of them were compared."""
    hits = 0
    for drafted, produced in zip(chain, committed):
        if drafted != produced:
            return hits, hits + 1
        hits += 1
    return hits, hits


@dataclass(frozen=True)
class NgramState:
    history: tuple[int, ...] = ()  # every token handed in so far (the prompt after its first token, then output)
    chain: tuple[int, ...] = ()  # the last drafted chain, below its root
    hits: int = 0
    tries: int = 0

    @property
    def rate(self) -> float:
        """Calibrated P(a drafted token is accepted | its parent was)."""
        return (self.hits + PRIOR_HITS) / (self.tries + PRIOR_TRIES)


@dataclass
class NgramProposer(Proposer):
    """Prompt lookup as a proposer: one chain per step, confidences from the sequence's running hit rate."""

    name: str = "ngram"
    max_ngram: int = MAX_NGRAM
    num_tokens: int = NUM_TOKENS
    reads_features: ClassVar[bool] = False  # prompt lookup: tokens only, so it combines with an EAGLE-3 head

    @property
    def head_names(self) -> list[str]:
        return []

    def init_state(self) -> NgramState:
        return NgramState()

    def propose(self, state: NgramState, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, NgramState]:
        new = next_tokens.tolist()
        hits, tries = matched_prefix(state.chain, new)
        history = state.history + tuple(new)
        chain = lookup(history, self.max_ngram, self.num_tokens)
        state = NgramState(history, tuple(chain), state.hits + hits, state.tries + tries)
        device = next_tokens.device
        depth = torch.arange(1, len(chain) + 1, dtype=torch.float32, device=device)
        tree = build_tree(
            to_device([new[-1], *chain], device),
            torch.arange(-1, len(chain), device=device),
            confidence=state.rate**depth,
            entropy=torch.zeros(len(chain), device=device),
        )
        return tree, state
