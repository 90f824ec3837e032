"""The drafting half of a decoding step over a batch, shared by the in-process loop (`generate.run_loop`) and
continuous batching (`continuous.ContinuousBatcher`): one proposer call per proposer per step, and the
paused-drafting rule written once.

Each sequence keeps `pending`, the (features, next tokens) its target committed since its proposer last drafted.
While drafting is paused (a large batch: speculation costs more than it saves) a step verifies only the root and
the pending list keeps growing; the first step that drafts again hands the proposer all of it, so its context
stays whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from taps_ray.drafting.proposers import NOT_DRAFTED, Proposer, propose_batch
from taps_ray.drafting.tree import DraftTree, root_only


@dataclass
class Drafting:
    """One sequence's drafting side: its proposer, the proposer's state, what it has not seen yet, and the
    tree drafted for the coming step with its drafting time and head (NOT_DRAFTED: paused)."""

    proposer: Proposer
    state: Any
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    tree: DraftTree | None = None
    draft_s: float = 0.0
    head: int = NOT_DRAFTED


def chosen_head(state: object) -> int:
    """Routers expose the head they used last as `state.last_head`; single heads are head 0."""
    return getattr(state, "last_head", 0)


def draft(sequences: list[Drafting], drafting: bool) -> None:
    """Every sequence's next tree (`Drafting.tree`). `drafting` False: root-only trees, pending kept. Else the
    sequences sharing a proposer draft in one `propose_batch` call, and `draft_s` is that call's time (as a
    step's verify time is the batch's forward)."""
    if not drafting:
        for seq in sequences:
            root = seq.pending[-1][1][-1:]
            seq.tree, seq.draft_s, seq.head = root_only(root, root.device), 0.0, NOT_DRAFTED
        return
    groups: dict[int, list[Drafting]] = {}
    for seq in sequences:
        groups.setdefault(id(seq.proposer), []).append(seq)
    for group in groups.values():
        features = [_joined([f for f, _ in seq.pending]) for seq in group]
        next_tokens = [_joined([t for _, t in seq.pending]) for seq in group]
        t0 = time.perf_counter()
        trees, states = propose_batch(group[0].proposer, [seq.state for seq in group], features, next_tokens)
        seconds = time.perf_counter() - t0
        for seq, tree, state in zip(group, trees, states, strict=True):
            seq.tree, seq.state, seq.pending, seq.draft_s, seq.head = tree, state, [], seconds, chosen_head(state)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The pending tensors as one (no copy for the usual single one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
