"""EAGLE-2 dynamic tree drafting (docs/algorithms.md): a head drafts `depth` levels of top-k candidates from the
target's features and its own stable cache, then keeps the most confident nodes as one `DraftTree` (drafting/tree.py)
per sequence; `draft_eagle2` is the one drafting entry, for a batch of sequences and (stacked) heads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from taps_ray.config import TreeConfig
from taps_ray.drafting.tree import DraftTree, build_tree, trees_from_rows
from taps_ray.models.cpu_linear import Projection, module_projection
from taps_ray.models.draft_head import DraftHead, KVCache
from taps_ray.syncs import to_device


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


@dataclass
class DraftContext:
    """The frozen pieces of the target that a head drafts with.

    `vocab` (optional) restricts drafting to a subset of token ids (EAGLE-3's reduced draft vocabulary): the
    draft LM head is then a slice of the target's, which is most of a draft step's cost on a CPU. Drafted ids
    are mapped back to the full vocabulary, so verification, and therefore losslessness, is unchanged.
    `norm` (an EAGLE-3 head's own, see `head_context`): the LM head is the head's, already one row per id of
    `vocab`, and reads norm(hidden).
    `dtype` (optional): the dtype the target's LM head drafts in when its heads draft in another than the
    target's (`serve.draft_dtype`); its rows are then a copy in that dtype.
    """

    embed: torch.nn.Module
    lm_head: torch.nn.Module
    vocab: torch.Tensor | None = None
    norm: torch.nn.Module | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # the LM head laid out for the device's fastest matmul (models/cpu_linear.py); the whole-vocabulary one in
        # the target's dtype is shared with the target's forward and every drafter of the same target
        if self.norm is not None or (self.vocab is None and self.dtype is None):
            self._projection = module_projection(self.lm_head)
        else:
            self._projection = vocab_projection(self.lm_head, self.vocab, self.dtype)
        if self.vocab is not None:
            self.vocab = self.vocab.to(self._projection.weight.device)  # drafted indices map to ids on that device

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities over the draft vocabulary (fp32)."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        return F.log_softmax(self._projection(hidden).float(), dim=-1)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices to target token ids."""
        return index if self.vocab is None else self.vocab[index]


def vocab_rows(lm_head: torch.nn.Module, vocab: torch.Tensor) -> torch.Tensor:
    """The rows of `vocab` of `lm_head`'s weight, contiguous. A head that reads its rows itself (`rows`: a CPU
    drafter's head mapped from the checkpoint, models/draft_parts.py) reads only those, not the whole matrix."""
    rows = getattr(lm_head, "rows", None)
    if rows is not None:
        return rows(vocab)
    weight = lm_head.weight
    return weight[vocab.to(weight.device)].contiguous()


_VOCAB_PROJECTION = "taps_vocab_projection"


def vocab_projection(lm_head: torch.nn.Module, vocab: torch.Tensor | None,
                     dtype: torch.dtype | None = None) -> Projection:
    """The projection onto the rows `vocab` (None: all) of `lm_head`, cast to `dtype` (None: kept as they are),
    kept on the module: every draft context over the same draft vocabulary shares one laid-out copy (a drafter
    actor holds several contexts)."""
    kept = getattr(lm_head, _VOCAB_PROJECTION, None)
    if kept is None or kept[1] != dtype or not _same_ids(kept[0], vocab):
        rows = lm_head.weight.detach() if vocab is None else vocab_rows(lm_head, vocab)
        kept = (None if vocab is None else vocab.clone(), dtype, Projection([rows.to(dtype or rows.dtype)]))
        object.__setattr__(lm_head, _VOCAB_PROJECTION, kept)  # a plain attribute: not in the state dict
    return kept[2]


def _same_ids(kept: torch.Tensor | None, vocab: torch.Tensor | None) -> bool:
    if kept is None or vocab is None:
        return kept is vocab
    return kept.shape == vocab.shape and torch.equal(kept, vocab.to(kept.device))


def head_context(head: DraftHead, ctx: DraftContext) -> DraftContext:
    """What `head` drafts with: the target's LM head (EAGLE-2, HASS) or, for an EAGLE-3 head, its own norm, LM
    head and draft vocabulary (the study's `ctx.vocab` does not apply to it); the token embedding is the target's."""
    if not head.eagle3:
        return ctx
    return DraftContext(ctx.embed, head.lm_head, head.draft_ids(), norm=head.norm)


@dataclass
class KVSlots:
    """Preallocated keys and values [N*S, kvh, capacity, hd] of S sequences drafted together by one head
    (N = 1) or a stack of N heads (models/stacked_head.py; row n*S + s: head n of sequence s; every head of a
    sequence sees the same committed inputs, so they share one length). `stable[s]`: sequence s's slots
    0..stable[s]-1 hold the newest stable cache written into them.

    A draft writes its tree's K/V after the stable caches and the next extension overwrites them, so drafting
    copies no cache. A state older than its sequence's `stable` that extends again (a branch), or a batch of
    states that are not exactly these S sequences in order, gets its own copy, so no state ever sees another's
    K/V."""

    kv: KVCache
    stable: list[int]

    @property
    def capacity(self) -> int:
        return int(self.kv[0].shape[2])

    @property
    def sequences(self) -> int:
        return len(self.stable)


@dataclass
class HeadCache:
    """A head's (or head stack's) stable cache of one sequence: K/V for draft positions 0..length-1, built from
    committed target features only; it is sequence `row` of `slots`."""

    slots: KVSlots | None = None
    length: int = 0
    row: int = 0

    @property
    def kv(self) -> KVCache | None:
        """The stable keys and values [N, kvh, length, hd] (views of the slots)."""
        if self.slots is None:
            return None
        s = self.slots.sequences
        return tuple(t.view(-1, s, *t.shape[1:])[:, self.row, :, : self.length] for t in self.slots.kv)


def reserve_slots(head: DraftHead, caches: list[HeadCache], needed: int) -> KVSlots:
    """Slots the sequences `caches` extend in place to `needed` positions: their shared ones when they are
    exactly those slots' sequences in order, each at its stable length, with room; else fresh slots holding a
    copy of each stable cache."""
    slots = caches[0].slots
    if (slots is not None and slots.sequences == len(caches) and slots.capacity >= needed
            and all(c.slots is slots and c.row == s and slots.stable[s] == c.length for s, c in enumerate(caches))):
        return slots
    config, weight = head.config, next(head.parameters())
    sequences = len(caches)
    shape = (head.stacked * sequences, config.num_key_value_heads, max(2 * needed, 256), config.head_dim)
    # zeros, not empty: a shorter sequence's rows are read (masked) up to the longest one's slots, and masked
    # garbage that happens to be NaN or inf would still poison attention (NaN * 0 = NaN)
    kv = (weight.new_zeros(shape), weight.new_zeros(shape))
    fresh = KVSlots(kv, [c.length for c in caches])
    for s, cache in enumerate(caches):  # a copy per sequence only when the batch changed
        if cache.length:
            for mine, theirs in zip(HeadCache(fresh, cache.length, s).kv, cache.kv):
                mine.copy_(theirs)
    return fresh


def extend_batch(
    head: DraftHead, ctx: DraftContext, caches: list[HeadCache], features: list[torch.Tensor],
    next_tokens: list[torch.Tensor], reserve: int = 0,
) -> tuple[torch.Tensor, list[HeadCache], torch.Tensor]:
    """Step A for S sequences in one forward: feed each sequence's (h_p, x_{p+1}) pairs of newly committed
    positions (their counts may differ: the head's linear layers run on the real ones only, `DraftHead.step`'s
    `packed`, and each row writes its own slots). Returns the last output of every stacked head of every sequence
    [N*S, d] (row n*S + s), the new caches, whose slots hold `reserve` more positions after the longest for the
    trees drafted next, and the last next token of each sequence [S] (the trees' roots).

    The committed tensors may come from another device (a target worker hands back CPU tensors); they move
    to the head's."""
    weight = next(head.parameters())
    dtype, device, n = weight.dtype, weight.device, head.stacked
    sequences = len(caches)
    counts = [int(t.numel()) for t in next_tokens]  # shapes: known on the host
    lengths = [c.length for c in caches]
    widest, most = max(lengths), max(counts)
    slots = reserve_slots(head, caches, widest + most + reserve)
    tokens = torch.cat([t.to(device) for t in next_tokens])  # [P]: every sequence's tokens in turn, unpadded
    feats = torch.cat([f.to(device=device, dtype=dtype) for f in features])
    # where each of them sits in the padded [S, M] layout (None when no row is padded: the same layout)
    packed = None if len(set(counts)) == 1 else to_device(
        [s * most + m for s, count in enumerate(counts) for m in range(count)], device)
    offsets = torch.arange(most, device=device)
    uniform = len(set(lengths)) == 1
    start_of = to_device(lengths, device)[:, None]  # [S, 1]
    slot = start_of + offsets  # [S, M]: where each new position's K/V goes
    columns = torch.arange(widest + most, device=device)
    seen = columns <= slot[:, :, None]  # [S, M, widest + M]: a row's committed slots and its new ones up to itself
    mask = seen[None].expand(n, -1, -1, -1).reshape(n * sequences, 1, most, widest + most)
    out = head.step(
        ctx.embed(tokens).to(dtype)[None].expand(n, -1, -1),
        feats[None].expand(n, -1, -1),
        slot.reshape(1, -1),  # positions = slots: a sequence's draft positions are contiguous
        mask,
        slots.kv,
        widest,
        sequences=sequences,
        write_index=None if uniform else slot[None].expand(n, -1, -1).reshape(n * sequences, most),
        packed=packed,
    )
    last = to_device(list(itertools.accumulate(counts, initial=-1))[1:], device)  # each sequence's last token
    hidden = out[:, last].reshape(n * sequences, -1)
    roots = tokens[last]
    new = [c + m for c, m in zip(lengths, counts)]
    slots.stable = list(new)
    return hidden, [HeadCache(slots, length, s) for s, length in enumerate(new)], roots


class Candidates:
    """EAGLE-2's candidate nodes of R trees drafted side by side, one row per tree, flat in drafting order: the
    root's top_k children, then per level the top_k children of each of the top_k frontier nodes (the previous
    level's best cumulative scores). Live drafting (`draft_eagle2`) and replay (decoding/replay_draft.py)
    both expand through it, so they rank, break ties and select alike."""

    def __init__(self, ctx: DraftContext, hidden: torch.Tensor, k: int) -> None:
        """The root's children, from the head's output at the root, `hidden` [R, d]."""
        rows, device = hidden.shape[0], hidden.device
        log_p = ctx.log_probs(hidden)
        scores, index = log_p.topk(k, dim=-1)
        tokens = ctx.token_ids(index)
        self.k = k
        self.tokens, self.scores = [tokens], [scores]
        self.entropy = [_entropy(log_p)[:, None].expand(rows, k)]
        self.parents = [torch.full((rows, k), -1, dtype=torch.long, device=device)]  # flat index of the parent
        self.frontier_tokens, self.frontier_scores = tokens, scores
        self.frontier_hidden = hidden[:, None].expand(rows, k, -1)
        self.frontier_flat = torch.arange(k, device=device).expand(rows, k)

    @property
    def width(self) -> int:
        """Candidates per row so far."""
        return sum(t.shape[1] for t in self.tokens)

    def expand(self, ctx: DraftContext, out: torch.Tensor) -> torch.Tensor:
        """Add the frontier's children, given the head's outputs at the frontier nodes `out` [R, k, d]; the new
        frontier is each row's k best children. Returns the old frontier node each new one extends [R, k]."""
        k, offset = self.k, self.width
        log_p = ctx.log_probs(out)  # [R, k, V]
        child_scores, child_index = log_p.topk(k, dim=-1)
        child_tokens = ctx.token_ids(child_index).flatten(1)
        cumulative = (child_scores + self.frontier_scores[:, :, None]).flatten(1)  # [R, k*k]
        self.tokens.append(child_tokens)
        self.scores.append(cumulative)
        self.entropy.append(_entropy(log_p).repeat_interleave(k, dim=1))
        self.parents.append(self.frontier_flat.repeat_interleave(k, dim=1))
        best_scores, best = cumulative.topk(k, dim=-1)
        parent_row = best // k
        self.frontier_tokens = child_tokens.gather(1, best)
        self.frontier_hidden = out.gather(1, parent_row[:, :, None].expand(-1, -1, out.shape[-1]))
        self.frontier_scores = best_scores
        self.frontier_flat = offset + best
        return parent_row

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every candidate's token, cumulative log-probability, parent's flat index (-1: root) and entropy,
        [R, width] each."""
        return tuple(torch.cat(c, dim=1) for c in (self.tokens, self.scores, self.parents, self.entropy))


def select_nodes(
    tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, entropy: torch.Tensor, n_draft: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's reranking per row: the n_draft candidates of highest cumulative log-probability `scores`.

    Candidates are flat [R, F] (`Candidates.flat`), parents before children. Returns the selected nodes'
    tokens, parents (node indices, 0 = the root), confidences and entropies, [R, min(n_draft, F)] each, in
    candidate order."""
    rows, device = tokens.shape[0], tokens.device
    # Stable descending sort per row: on equal scores the lower flat index (a parent before its child) wins.
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :n_draft]
    selected = order.sort(dim=1).values
    n = selected.shape[1]
    node_of_flat = torch.full_like(tokens, -1)
    node_of_flat.scatter_(1, selected, torch.arange(1, n + 1, device=device).expand(rows, n))
    parent_flat = parents.gather(1, selected)
    # A child's cumulative score never exceeds its parent's and ties go to the lower flat index, so a selected
    # node's parent is always selected (checked by tests/test_engine.py, not here: reading it would sync).
    node_parents = torch.where(parent_flat < 0, 0, node_of_flat.gather(1, parent_flat.clamp(min=0)))
    return tokens.gather(1, selected), node_parents, scores.gather(1, selected).exp(), entropy.gather(1, selected)


def select_tree(
    root: int, n_draft: int, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, entropy: torch.Tensor
) -> DraftTree:
    """`select_nodes` of one tree's flat candidates [F], under `root`."""
    device = tokens.device
    nodes, node_parents, confidence, node_entropy = (
        t[0] for t in select_nodes(tokens[None], scores[None], parents[None], entropy[None], n_draft))
    return build_tree(
        torch.cat([to_device([root], device), nodes]),
        torch.cat([to_device([-1], device), node_parents]),
        confidence=confidence,
        entropy=node_entropy,
    )


class ConfidenceStop:
    """The `min_confidence` rule of R trees expanded side by side (live drafting and replay alike): a row stops
    expanding once its best frontier node's cumulative probability falls below `min_confidence`; its later
    candidates are never selected, so its tree is what it would be had it stopped drafting there
    (docs/algorithms.md#draft-confidence-stop). Inactive (no host reads) for `min_confidence` 0."""

    def __init__(self, min_confidence: float, rows: int, device: torch.device) -> None:
        self.below = math.log(min_confidence) if min_confidence > 0 else -math.inf
        self.stopped = torch.full((rows,), -1, dtype=torch.long, device=device)  # per row: its candidates then

    @property
    def active(self) -> bool:
        return self.below > -math.inf

    def all_stopped(self, candidates: Candidates) -> bool:
        """Before a level: mark the rows that stop now; whether every row has (one read per level)."""
        if not self.active:
            return False
        newly = (candidates.frontier_scores[:, 0] < self.below) & (self.stopped < 0)
        self.stopped = torch.where(newly, candidates.width, self.stopped)
        return bool((self.stopped >= 0).all())

    def widths(self, width: int) -> torch.Tensor:
        """Each row's candidates [R]: those before it stopped (all `width` for a row that never stopped)."""
        return torch.where(self.stopped < 0, width, self.stopped)

    def scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Flat candidate scores [R, F] with each row's candidates after its stop at -inf (never selected)."""
        if not self.active:
            return scores
        late = torch.arange(scores.shape[1], device=scores.device) >= self.widths(scores.shape[1])[:, None]
        return scores.masked_fill(late, -math.inf)

    def sizes(self, width: int, drafted: int) -> torch.Tensor:
        """Each row's tree size, root included, of `drafted` selected nodes out of `width` candidates: the
        selection comes in flat order, so a row's valid nodes come first."""
        return self.widths(width).clamp(max=drafted) + 1


# The head over R rows' frontiers at one level: tokens [R, k], hidden [R, k, d], ancestors [R, k, k*(level+1)]
# (whether tree node j, the frontiers of levels 0..level level-major, is frontier node i's ancestor or itself),
# level -> the head's outputs [R, k, d].
LevelForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def expand_levels(
    ctx: DraftContext, candidates: Candidates, passes: int, stop: ConfidenceStop, forward: LevelForward
) -> None:
    """EAGLE-2's level step, `passes` times or until `stop` stops every row: the head reads every row's frontier
    (`forward`) and each row keeps its k best children. Live drafting (`draft_eagle2`) and replay
    (decoding/replay_draft.py) differ only in `forward`: which cache the frontier attends to."""
    rows, k = candidates.frontier_tokens.shape
    eye = torch.eye(k, dtype=torch.bool, device=candidates.frontier_tokens.device).expand(rows, k, k)
    ancestors = eye
    for level in range(passes):
        if stop.all_stopped(candidates):
            break
        out = forward(candidates.frontier_tokens, candidates.frontier_hidden, ancestors, level)
        parent_row = candidates.expand(ctx, out)
        kept = ancestors.gather(1, parent_row[:, :, None].expand(-1, -1, ancestors.shape[-1]))
        ancestors = torch.cat([kept, eye], dim=2)


@torch.no_grad()
def draft_eagle2(
    head: DraftHead,
    ctx: DraftContext,
    caches: list[HeadCache],
    features: list[torch.Tensor],
    next_tokens: list[torch.Tensor],
    tree: TreeConfig,
) -> tuple[list[list[DraftTree]], list[HeadCache]]:
    """EAGLE-2 dynamic trees, the one drafting entry: for each of S sequences and each stacked head
    (`head.stacked`; one for a plain head) expand the top_k best nodes per level and keep the total_token-1 best
    candidates (`tree`'s settings). Returns, per sequence, one tree per stacked head, and the sequences' new caches.

    One forward per tree level drafts every head of every sequence (rows n*S + s); selection, masks, positions
    and the trees' structure are built on the device, so without `min_confidence` the host reads one small
    tensor per call (which trees are chains). `features[s]` [m, d] are sequence s's target features of the
    newly committed positions ([m, k*d] fused layers for an EAGLE-3 head, whose deeper levels read its own
    outputs) and `next_tokens[s]` [m] the tokens that follow each of them; the last of these is the root.
    `ctx` is the head's (`head_context`). `tree.min_confidence` > 0 stops expanding a tree once its best frontier
    node's cumulative probability falls below it: deeper nodes would be less likely still to be accepted
    (docs/algorithms.md#draft-confidence-stop); deciding to stop reads the frontier once per level.
    """
    n_draft, k = tree.total_token - 1, tree.top_k
    # Every pass the tree's size can reach, even for a tree no wider than one level (n_draft <= k): a deep node
    # can outscore a root child, and EAGLE's topK_genrate keeps the n_draft best of all k + depth*k^2 candidates.
    passes = tree.passes
    hidden, caches, roots = extend_batch(head, ctx, caches, features, next_tokens, reserve=passes * k)
    sequences, n = len(caches), head.stacked
    candidates = Candidates(ctx, hidden, k)
    forward = _cached_level_forward(head, ctx, caches, k, passes, hidden.dtype, hidden.device)
    stop = ConfidenceStop(tree.min_confidence, n * sequences, hidden.device)
    expand_levels(ctx, candidates, passes, stop, forward)
    trees = _selected_trees(candidates, stop, roots.repeat(n), n_draft)
    return [trees[s::sequences] for s in range(sequences)], caches


def _cached_level_forward(head: DraftHead, ctx: DraftContext, caches: list[HeadCache], k: int, passes: int,
                          dtype: torch.dtype, device: torch.device) -> LevelForward:
    """Live drafting's `LevelForward`: the tree K/V go after the longest sequence's cache; each row (n*S + s) sees
    its own sequence's committed slots, then its tree columns = each frontier node's ancestors + self."""
    sequences, n = len(caches), head.stacked
    rows = n * sequences
    start = max(c.length for c in caches)
    lengths = to_device([c.length for c in caches], device)
    mask = torch.zeros(rows, k, start + passes * k, dtype=torch.bool, device=device)
    mask[:, :, :start] = (torch.arange(start, device=device) < lengths[:, None]).repeat(n, 1)[:, None]

    def forward(tokens: torch.Tensor, frontier: torch.Tensor, ancestors: torch.Tensor, level: int) -> torch.Tensor:
        end = start + (level + 1) * k
        mask[:, :, start:end] = ancestors
        return head.step(
            ctx.embed(tokens).to(dtype).reshape(n, sequences * k, -1),
            frontier.reshape(n, sequences * k, -1),
            (lengths[:, None] + level).expand(-1, k).reshape(1, -1),  # broadcast over heads
            mask[:, None, :, :end],
            caches[0].slots.kv,
            end - k,
            sequences=sequences,
        ).reshape(rows, k, -1)

    return forward


def _selected_trees(candidates: Candidates, stop: ConfidenceStop, roots: torch.Tensor, n_draft: int
                    ) -> list[DraftTree]:
    """One tree per row of `candidates`: its `n_draft` best nodes (fewer where `stop` ended it early) under the
    row's root (`roots` [R]), with each tree's chain flag read in the same host read as the stopped sizes."""
    tokens, scores, parents, entropy = candidates.flat()
    nodes, node_parents, confidence, node_entropy = select_nodes(tokens, stop.scores(scores), parents, entropy,
                                                                 n_draft)
    rows, size, device = nodes.shape[0], nodes.shape[1] + 1, nodes.device
    tokens = torch.cat([roots[:, None], nodes], dim=1)
    parents = torch.cat([torch.full((rows, 1), -1, dtype=torch.long, device=device), node_parents], dim=1)
    prefix = (parents == torch.arange(-1, size - 1, device=device)).long().cumprod(-1).sum(-1)  # chain nodes
    if stop.active:
        kept = stop.sizes(candidates.width, size - 1)
        chains, sizes = torch.stack([(prefix >= kept).long(), kept]).tolist()
    else:
        chains, sizes = (prefix == size).tolist(), None
    return trees_from_rows(tokens, parents, confidence, node_entropy, sizes=sizes, chains=[bool(c) for c in chains])
