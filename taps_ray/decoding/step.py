"""One decoding step over a batch of sequences (draft, verify, accept, commit) and what it records.

Every loop runs this step, so a rule written here holds everywhere: the in-process loop and the Ray drafters
(`generate.run_loop`, over a `TargetBatch` or over a `WorkerVerifier` whose target worker batches many drafters'
trees in its `VerificationPool`), continuous batching in Serve (`continuous.ContinuousBatcher`) and replay
(`replay.replay`: `run_loop` over a `TraceVerifier` that answers from recorded greedy traces). The step drafts
every live sequence's tree, verifies them all in ONE verifier call (one target forward), then commits each
sequence's tokens (cut at a stop token or its budget), hands its proposer the committed positions and appends a
`StepRecord`; a loop adds only what is its own (admission and eviction, stop strings, log-probabilities,
streaming: `Decoding.commit` is the seam).

Drafting is one proposer call per proposer per step: the sequences sharing a proposer draft in one
`propose_batch`. Each sequence keeps `pending`, the (features, next tokens) its target committed since its proposer
last drafted. While drafting is paused (the loop's `draft_gate.DraftGate`: a large batch, where a batched target
forward over many tree tokens is compute-bound and speculation costs more than it saves) a step verifies only the
root and the pending list keeps growing; the first step that drafts again hands the proposer all of it, so its
context stays whole.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from taps_ray.drafting.proposer import NOT_DRAFTED, Feedback, Proposer, join_pending
from taps_ray.drafting.tree import DraftTree, root_only

if TYPE_CHECKING:  # annotations only: the step runs over any `Verifier`, the target batch is one of them
    from taps_ray.decoding.target_batch import Committed
    from taps_ray.decoding.verify import SamplingParams, Verdict


class Verifier(Protocol):
    """The target side of the loop: in-process `TargetBatch`, a proxy to a Ray target worker, or replay's recorded
    traces. `step` gets one tree per sequence, None for a finished one (it leaves the batch for good), and answers
    every tree; `decode_step` calls it (or any callable of its shape, as Serve's batcher steps some rows) once a
    step."""

    def start(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Committed]: ...

    def step(self, trees: list[DraftTree | None]) -> list[Committed | None]: ...


@dataclass
class StepRecord:
    accepted: int  # drafted tokens accepted (a_k); the step commits a_k + 1 tokens
    new_tokens: int  # tokens this step committed, trimmed after a stop token only (`step_tokens`)
    tree_size: int  # nodes verified, root included
    draft_s: float
    verify_s: float
    head: int  # which head's tree was verified (routers), -1 for a merged tree, NOT_DRAFTED (-2) for none
    node_confidence: list[float]
    node_entropy: list[float]
    node_accepted: list[bool]
    node_source: list[int]


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated tokens, cut after the first stop token
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0
    finished_by: str = ""
    seed: int = 0  # the sampling seed the sequence drew with (`run_loop` fills it): passed back, it repeats the run

    @property
    def tau(self) -> float:
        return tau(self.steps)

    @property
    def tau_taps(self) -> float:
        """The TAPS/EAGLE reference definition: untrimmed committed tokens over (steps - 1); nan for a one-step
        turn, which adds its tokens but no step to a cell's pooled τ_TAPS (docs/algorithms.md#acceptance-length)."""
        committed = sum(s.accepted + 1 for s in self.steps)
        return committed / (len(self.steps) - 1) if len(self.steps) > 1 else math.nan


def tau(steps: Sequence[StepRecord]) -> float:
    """τ, the one definition every report uses (Spec-Bench #MAT): tokens per target verification step (the
    prefill's first token excluded), over one generation's steps or several pooled; 0 without a step."""
    return sum(s.new_tokens for s in steps) / len(steps) if steps else 0.0


NodeValues = tuple[list[float], list[float], list[int]]  # a tree's per-node (confidence, entropy, source)


def head_counts(records: Iterable[StepRecord], head_names: Sequence[str] | None = None) -> Counter:
    """Verification steps per head whose tree was verified (key -1 = a merged tree, `NOT_DRAFTED` = none).

    With `head_names`, heads are keyed by name ("merged" for -1, "none" for `NOT_DRAFTED`); otherwise by index.
    """
    counts = Counter(r.head for r in records)
    if head_names is None:
        return counts

    def name(head: int) -> str:
        if head == NOT_DRAFTED:
            return "none"
        return "merged" if head < 0 else head_names[head]

    return Counter({name(h): counts[h] for h in sorted(counts)})


def record_step(tree: DraftTree, verdict: Verdict, new_tokens: int, draft_s: float, verify_s: float, head: int,
                nodes: NodeValues | None) -> StepRecord:
    """One step's record; `nodes`: the tree's per-node values already read to the host (`node_values`: one read
    for the whole batch, not one per tree), or None when the loop keeps no per-node diagnostics (the node lists
    are then empty)."""
    accepted = [False] * tree.size
    for node in verdict.nodes:
        accepted[node] = True
    confidence, entropy, source = nodes if nodes is not None else ([], [], [])
    return StepRecord(
        accepted=verdict.accepted,
        new_tokens=new_tokens,
        tree_size=tree.size,
        draft_s=draft_s,
        verify_s=verify_s,
        head=head,
        node_confidence=confidence,
        node_entropy=entropy,
        node_accepted=accepted[1:] if nodes is not None else [],
        node_source=source,
    )


def node_values(trees: list[DraftTree]) -> list[NodeValues]:
    """Each tree's per-node confidences, entropies and sources on the host, in one device-to-host read."""
    if not trees:
        return []
    flat = torch.stack([torch.cat([getattr(t, name) for t in trees]).double()  # one device: the loop's drafters'
                        for name in ("confidence", "entropy", "source")]).tolist()
    out, at = [], 0
    for tree in trees:
        n = tree.size - 1
        conf, ent, src = (row[at : at + n] for row in flat)
        out.append((conf, ent, [int(s) for s in src]))
        at += n
    return out


def extend_tokens(generation: Generation, new: list[int], stop_ids: set[int], max_new_tokens: int) -> int:
    """Append new tokens, cut at the first stop token or at max_new_tokens; returns how many were kept."""
    kept = 0
    for token in new:
        if generation.finished_by:
            break
        generation.tokens.append(token)
        kept += 1
        if token in stop_ids:
            generation.finished_by = "stop"
        elif len(generation.tokens) >= max_new_tokens:
            generation.finished_by = "length"
    return kept


def step_tokens(new: list[int], stop_ids: set[int]) -> int:
    """A step's Spec-Bench new tokens: all it committed, cut just after the first stop token. The token budget does
    not trim it, so the step that crosses `max_new_tokens` keeps its full accepted length
    (docs/algorithms.md#acceptance-length)."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return i + 1
    return len(new)


# --- drafting ------------------------------------------------------------------------------------------------


@dataclass
class Drafting:
    """One sequence's drafting side: its proposer, the proposer's state, what it has not seen yet, and the
    tree drafted for the coming step with its drafting time and head (NOT_DRAFTED: paused); `proposed`: whether
    the proposer drafted that tree (False while drafting is paused), so it hears back what was accepted."""

    proposer: Proposer
    state: Any
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    tree: DraftTree | None = None
    draft_s: float = 0.0
    head: int = NOT_DRAFTED
    proposed: bool = False


def draft(sequences: list[Drafting], drafting: bool) -> None:
    """Every sequence's next tree (`Drafting.tree`). `drafting` False: root-only trees, pending kept. Else the
    sequences sharing a proposer draft in one `propose_batch` call, and `draft_s` is that call's time (as a
    step's verify time is the batch's forward)."""
    if not drafting:
        for seq in sequences:
            root = seq.pending[-1][1][-1:]
            seq.tree, seq.draft_s, seq.head, seq.proposed = root_only(root, root.device), 0.0, NOT_DRAFTED, False
        return
    groups: dict[int, list[Drafting]] = {}
    for seq in sequences:
        groups.setdefault(id(seq.proposer), []).append(seq)
    for group in groups.values():
        features, next_tokens = map(list, zip(*(join_pending(seq.pending) for seq in group)))
        t0 = time.perf_counter()
        proposer = group[0].proposer
        trees, states = proposer.propose_batch([seq.state for seq in group], features, next_tokens)
        seconds = time.perf_counter() - t0
        for seq, tree, state in zip(group, trees, states, strict=True):
            seq.tree, seq.state, seq.pending, seq.draft_s = tree, state, [], seconds
            seq.head, seq.proposed = proposer.head_of(state), True


def observe(verified: list[tuple[Drafting, DraftTree, Committed]]) -> None:
    """Hand each proposer what verification accepted of the trees it drafted this step (`Proposer.observe`),
    one call per proposer, as drafting is; trees the loop made while drafting was paused are not its own."""
    groups: dict[int, list[tuple[Drafting, Feedback]]] = {}
    for seq, tree, committed in verified:
        if seq.proposed:
            feedback = Feedback(tree, committed.verdict.nodes, committed.tokens)
            groups.setdefault(id(seq.proposer), []).append((seq, feedback))
    for group in groups.values():
        states = group[0][0].proposer.observe([seq.state for seq, _ in group], [f for _, f in group])
        for (seq, _), state in zip(group, states, strict=True):
            seq.state = state


# --- the step ------------------------------------------------------------------------------------------------


@dataclass
class Decoding:
    """One sequence of a loop: its output so far, its drafting side, its token budget and the stop tokens."""

    generation: Generation
    drafting: Drafting
    budget: int
    stops: set[int]

    def extend(self, committed: Committed) -> int:
        """Take what the target committed (the prefill's first token or a step's): extend the output, cut at a
        stop token or the budget, and queue the committed positions for the proposer; returns the tokens kept."""
        self.drafting.pending.append((committed.features, committed.next_tokens))
        return extend_tokens(self.generation, committed.tokens, self.stops, self.budget)

    def commit(self, committed: Committed) -> int:
        """`extend`, returning what the step's record counts as new tokens: Spec-Bench's, all the step committed
        up to a stop token (`step_tokens`). A loop with more to do per commit (Serve's stop strings, log-probabilities,
        streaming) overrides this."""
        self.extend(committed)
        return step_tokens(committed.tokens, self.stops)


def decode_step(
    sequences: Sequence[Decoding],
    verify: Callable[[list[DraftTree | None]], Sequence[Committed | None]],
    drafting: bool,
    node_stats: bool = True,
) -> int:
    """One step of every unfinished sequence: draft (root-only trees unless `drafting`: the loop's `DraftGate`
    decides from the batch), verify every tree in one `verify` call (trees in the order of `sequences`, None for a
    finished sequence: the `Verifier.step` contract), commit and record, then tell each proposer what was accepted
    (`observe`). `draft_s` is the sequence's drafting call, `verify_s` the verify call. `node_stats`: record every
    node's confidence, entropy, source and acceptance (eval and replay read them; reading them back costs a device
    sync and host work per step, so Serve leaves them out unless asked). Returns the tokens the step's records
    count as new, summed over the batch."""
    live = [seq for seq in sequences if not seq.generation.finished_by]
    draft([seq.drafting for seq in live], drafting)
    trees = [None if seq.generation.finished_by else seq.drafting.tree for seq in sequences]
    t0 = time.perf_counter()
    results = verify(trees)
    verify_s = time.perf_counter() - t0
    stepped = [(seq, tree, committed) for seq, tree, committed in zip(sequences, trees, results, strict=True)
               if tree is not None]
    nodes = node_values([tree for _, tree, _ in stepped]) if node_stats else [None] * len(stepped)
    total = 0
    for (seq, tree, committed), tree_nodes in zip(stepped, nodes):
        if committed is None:
            raise RuntimeError("the verifier returned no result for a tree it was given; a Verifier answers every "
                               "tree of a step (None only for a finished sequence's None tree)")
        seq.drafting.tree = None
        new_tokens = seq.commit(committed)
        total += new_tokens
        seq.generation.steps.append(record_step(tree, committed.verdict, new_tokens, seq.drafting.draft_s, verify_s,
                                                seq.drafting.head, tree_nodes))
    observe([(seq.drafting, tree, committed) for seq, tree, committed in stepped])
    return total
