"""Replay's drafting (docs/algorithms.md#replay): every tree a head would draft along greedy traces, in a few
batched forwards instead of one small draft pass per step and question.

At T = 0 the committed context at every step is a prefix of the recorded sequence, so the tree an EAGLE head
drafts with its root at position c depends only on the trace and c. `replay_drafters` therefore drafts, per
head, the tree at every root position the replay can reach: (1) one teacher-forced causal head forward over
each whole trace gives the head's K/V and the depth-1 output at every position; (2) the deeper levels expand
all (trace, position) rows at once, each row's nodes attending to its own trace prefix and its tree ancestors
(one 4-D mask per block of rows); (3) the EAGLE-2 top-k, rerank and selection run per row through the live
drafter's own `Candidates` and `select_nodes` (drafting/eagle2.py: same order of operations, same tie-breaking).
Each `SingleHead` inside the proposer (alone, routed, merged, averaged, + n-gram, cost-aware) is then swapped
for a `ReplayedHead` that answers `propose` from those trees; every other proposer part (n-gram lookup, plain)
drafts as in the live loop.

In exact arithmetic the trees equal the live loop's; batched matmuls round differently in the last bits, so a
draft near-tie can flip (tests/test_replay.py counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch

from taps_ray.config import TreeConfig
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.eagle2 import Candidates, ConfidenceStop, DraftContext, expand_levels, select_nodes
from taps_ray.drafting.tree import DraftTree, build_tree
from taps_ray.models.draft_head import DraftHead, KVCache
from taps_ray.syncs import to_device

CONTEXT_BUDGET = 1 << 22  # traces per causal head forward: batch x length^2 (the attention scores) at most this
NODE_BUDGET = 1024  # tree nodes per level forward (rows x top_k): bounds the [nodes, vocab] log-probabilities
BLOCK_NODES = 128  # nodes of one trace per attention block: one block's queries see its trace and its own rows


@dataclass
class TraceTrees:
    """One head's trees along one trace: row i is the tree whose root sits at sequence position `first` + i
    (its drafted nodes in `draft_eagle2`'s node order; parents index nodes, 0 = the root)."""

    first: int
    roots: list[int]
    tokens: torch.Tensor  # [R, n] long
    parents: torch.Tensor  # [R, n] long
    confidence: torch.Tensor  # [R, n] float32
    entropy: torch.Tensor  # [R, n] float32
    sizes: list[int] | None = None  # per row: its drafted nodes (`min_confidence` stopped it early); None: all n

    def covers(self, roots: range) -> bool:
        return roots.start == self.first and len(roots) == len(self.roots)

    def tree(self, position: int) -> DraftTree:
        row = position - self.first
        if not 0 <= row < len(self.roots):
            raise ValueError(
                f"replay asked for a tree at position {position}, outside the drafted roots "
                f"{self.first}..{self.first + len(self.roots) - 1}"
            )
        device = self.tokens.device
        n = self.tokens.shape[1] if self.sizes is None else self.sizes[row]
        return build_tree(
            torch.cat([to_device([self.roots[row]], device), self.tokens[row, :n]]),
            torch.cat([to_device([-1], device), self.parents[row, :n]]),
            confidence=self.confidence[row, :n],
            entropy=self.entropy[row, :n],
        )


@dataclass
class ReplayedHead(Proposer):
    """A `SingleHead`'s stand-in during replay; its state is the number of committed positions it was handed,
    so the tree it returns is the precomputed one at the new root position."""

    name: str
    trees: TraceTrees
    feature_layers: tuple[int, ...] = ()

    @property
    def head_names(self) -> list[str]:
        return [self.name]

    def init_state(self) -> int:
        return 0

    def propose(self, state: int, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, int]:
        length = state + int(next_tokens.numel())
        return self.trees.tree(length), length


# Per trace: a head's trees by tree settings. Weakly keyed by the head, so the trees of a head that is gone (an
# averaged head built for one cell) go with it, while the study's heads, which a drafter keeps, are drafted once
# per trace and shared by every proposer that uses them (alone, routed, merged).
TreeMemo = WeakKeyDictionary[DraftHead, dict[str, TraceTrees]]


@torch.no_grad()
def replay_drafters(
    proposer: Proposer,
    sequences: Sequence[list[int]],
    features: Sequence[torch.Tensor],
    roots: Sequence[range],
    memos: Sequence[TreeMemo],
) -> list[Proposer]:
    """Per trace, `proposer` with its heads answering from trees drafted at the root positions `roots[i]` of
    `sequences[i]` (prompt + greedy continuation) with target features `features[i]`. `memos[i]`: trace i's trees
    already drafted by earlier proposers (read and filled). A proposer with a `replay_refusal` cannot be replayed
    (a cost-aware one decides from measured draft and verify times, which replay does not have)."""
    if proposer.replay_refusal is not None:
        raise ValueError(f"{proposer.name!r} {proposer.replay_refusal}")
    singles: dict[int, SingleHead] = {}
    proposer.map_heads(lambda s: singles.setdefault(id(s), s))
    trees = {key: _remembered(s, sequences, features, roots, memos) for key, s in singles.items()}

    def replayed(i: int) -> Callable[[SingleHead], Proposer]:
        return lambda s: ReplayedHead(s.name, trees[id(s)][i], s.feature_layers)

    return [proposer.map_heads(replayed(i)) for i in range(len(sequences))]


def _remembered(head: SingleHead, sequences: Sequence[list[int]], features: Sequence[torch.Tensor],
                roots: Sequence[range], memos: Sequence[TreeMemo]) -> list[TraceTrees]:
    """`draft_along` for `head`, drafting only the traces whose memo lacks its trees for these roots."""
    settings = head.tree.model_dump_json()
    found = [memo.get(head.head, {}).get(settings) for memo in memos]
    missing = [i for i, (hit, r) in enumerate(zip(found, roots)) if hit is None or not hit.covers(r)]
    drafted = draft_along(head.head, head.context, head.tree, [sequences[i] for i in missing],
                          [features[i] for i in missing], [roots[i] for i in missing]) if missing else []
    for i, trees in zip(missing, drafted):
        found[i] = trees
        memos[i].setdefault(head.head, {})[settings] = trees
    return found


@torch.no_grad()
def draft_along(
    head: DraftHead,
    ctx: DraftContext,
    tree: TreeConfig,
    sequences: Sequence[list[int]],
    features: Sequence[torch.Tensor],
    roots: Sequence[range],
) -> list[TraceTrees]:
    """The EAGLE-2 tree `draft_eagle2(head, ctx, ..., tree)` would draft at every root position of every trace."""
    traces = list(zip(sequences, features, roots))
    out: list[TraceTrees] = []
    for group in _groups([r.stop for r in roots], [len(r) for r in roots], tree.top_k):
        out += _draft_group(head, ctx, tree, [traces[i] for i in group])
    return out


def _groups(lengths: list[int], rows: list[int], k: int) -> list[list[int]]:
    """Consecutive traces drafted together, within `CONTEXT_BUDGET` and `NODE_BUDGET` (at least one each)."""
    groups: list[list[int]] = []
    longest = nodes = 0
    for i, (length, n) in enumerate(zip(lengths, rows)):
        grown = max(longest, length)
        if groups and (grown * grown * (len(groups[-1]) + 1) <= CONTEXT_BUDGET and nodes + n * k <= NODE_BUDGET):
            groups[-1].append(i)
            longest, nodes = grown, nodes + n * k
        else:
            groups.append([i])
            longest, nodes = length, n * k
    return groups


def teacher_forced(
    head: DraftHead, ctx: DraftContext, sequences: Sequence[list[int]], features: Sequence[torch.Tensor],
    stops: Sequence[int],
) -> tuple[torch.Tensor, KVCache]:
    """One causal head forward over every trace at once, trace b up to root position `stops[b]` - 1: head
    position i reads (feature i, token i + 1), so output c - 1 is what the head drafts a root at c's children
    from. Returns the outputs [B, width, d] (right-padded) and the head's K/V."""
    weight = next(head.parameters())
    dtype, device = weight.dtype, weight.device
    width = max(max(stop - 1, 1) for stop in stops)
    padded = [sequence[1:stop] + [0] * (width - (stop - 1)) for sequence, stop in zip(sequences, stops)]
    tokens = to_device(padded, device, torch.long)  # one transfer for the whole group
    inputs = torch.zeros(len(stops), width, features[0].shape[-1], dtype=dtype, device=device)
    for b, stop in enumerate(stops):
        inputs[b, : stop - 1] = features[b][: stop - 1].to(device=device, dtype=dtype)
    positions = torch.arange(width, device=device).expand(len(stops), -1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return head(ctx.embed(tokens).to(dtype), inputs, positions, causal[None, None], None)


def _draft_group(
    head: DraftHead, ctx: DraftContext, tree: TreeConfig, traces: list[tuple[list[int], torch.Tensor, range]]
) -> list[TraceTrees]:
    """`draft_along` for traces drafted together: (sequence, features, root positions) each."""
    sequences, features, roots = zip(*traces)
    weight = next(head.parameters())
    dtype, device = weight.dtype, weight.device
    k, n_draft = tree.top_k, tree.total_token - 1

    # (1) teacher-forced head forward; a root at c reads output c-1
    context, kv = teacher_forced(head, ctx, sequences, features, [r.stop for r in roots])
    width = context.shape[1]

    # one row per (trace, root position), trace-major
    trace_of = to_device([b for b, r in enumerate(roots) for _ in r], device, torch.long)
    root_at = to_device([c for r in roots for c in r], device, torch.long)
    rows = int(root_at.numel())
    if rows == 0:
        return [_trace_trees(r, sequences[b], None, b, trace_of) for b, r in enumerate(roots)]
    hidden = context[trace_of, root_at - 1]  # [R, d]

    candidates = Candidates(ctx, hidden, k)
    blocks = _Blocks(trace_of, root_at, kv, k, width)

    def forward(tokens: torch.Tensor, frontier: torch.Tensor, ancestors: torch.Tensor, level: int) -> torch.Tensor:
        return blocks.forward(head, ctx, tokens, frontier, ancestors, level, dtype)  # [R, k, d]

    stop = ConfidenceStop(tree.min_confidence, rows, device)  # as live drafting stops
    # as live drafting: every pass the tree's size can reach (`TreeConfig.passes`)
    expand_levels(ctx, candidates, tree.passes, stop, forward)

    tokens, scores, parents, entropy = candidates.flat()
    drafted = select_nodes(tokens, stop.scores(scores), parents, entropy, n_draft)
    sizes = (stop.sizes(candidates.width, drafted[0].shape[1]) - 1).tolist() if stop.active else None
    return [_trace_trees(r, sequences[b], drafted, b, trace_of, sizes) for b, r in enumerate(roots)]


def _trace_trees(
    r: range, sequence: list[int], drafted: tuple[torch.Tensor, ...] | None, b: int, trace_of: torch.Tensor,
    sizes: list[int] | None = None,
) -> TraceTrees:
    """Trace b's rows of the group's drafted (tokens, parents, confidence, entropy)."""
    if drafted is None:
        empty = torch.zeros(0, 0, device=trace_of.device)
        return TraceTrees(r.start, [], empty.long(), empty.long(), empty, empty)
    mine = (trace_of == b).nonzero().flatten()
    tokens, parents, confidence, entropy = (t[mine] for t in drafted)
    mine_sizes = None if sizes is None else [sizes[i] for i in mine.tolist()]
    return TraceTrees(r.start, [sequence[c] for c in r], tokens, parents, confidence.float(), entropy.float(),
                      mine_sizes)


class _Blocks:
    """The level forwards of a group's rows: rows are cut into blocks of one trace (at most `BLOCK_NODES` nodes),
    the blocks are batched, and a block's queries attend to its trace's head K/V before their root and to the
    tree nodes of their own row that `ancestors` marks."""

    def __init__(self, trace_of: torch.Tensor, root_at: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                 k: int, width: int) -> None:
        per_block = max(BLOCK_NODES // k, 1)
        starts: list[int] = []
        traces = trace_of.tolist()
        for i, t in enumerate(traces):
            if not starts or t != traces[starts[-1]] or i - starts[-1] >= per_block:
                starts.append(i)
        bounds = [*starts, len(traces)]
        self.k, self.rows_per = k, max(b - a for a, b in zip(bounds, bounds[1:]))
        device = root_at.device
        index = torch.full((len(starts), self.rows_per), -1, dtype=torch.long, device=device)
        for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
            index[j, : b - a] = torch.arange(a, b, device=device)
        self.valid = index >= 0
        self.index = index.clamp(min=0)  # a padding row repeats row 0: its outputs are dropped
        block_trace = trace_of[self.index[:, 0]]
        self.cache = (kv[0][block_trace], kv[1][block_trace])
        self.root_at = root_at[self.index]  # [blocks, rows]
        before_root = torch.arange(width, device=device) < self.root_at[..., None]  # [blocks, rows, width]
        self.prefix = before_root.repeat_interleave(k, dim=1)  # [blocks, rows*k, width]
        self.same_row = torch.eye(self.rows_per, dtype=torch.bool, device=device)[None, :, None, None, :, None]

    def forward(self, head: DraftHead, ctx: DraftContext, tokens: torch.Tensor, hidden: torch.Tensor,
                ancestors: torch.Tensor, level: int, dtype: torch.dtype) -> torch.Tensor:
        """One tree level: frontier tokens [R, k], hidden [R, k, d], ancestors [R, k, k*(level+1)] -> [R, k, d]."""
        blocks, n, k = self.index.shape[0], self.rows_per, self.k
        queries = n * k
        mine = ancestors[self.index].view(blocks, n, k, level + 1, 1, k)
        tree_mask = (self.same_row & mine).reshape(blocks, queries, (level + 1) * queries)
        mask = torch.cat([self.prefix, tree_mask], dim=2)[:, None]
        positions = (self.root_at + level).repeat_interleave(k, dim=1)
        out, self.cache = head(
            ctx.embed(tokens[self.index].reshape(blocks, queries)).to(dtype),
            hidden[self.index].reshape(blocks, queries, -1),
            positions,
            mask,
            self.cache,
        )
        return out.view(blocks, n, k, -1)[self.valid]
