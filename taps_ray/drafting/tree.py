"""Draft trees: the data every proposer hands to the verifier, and EAGLE-2 dynamic tree drafting.

A tree is a handful of explicit tensors (tokens, parents, depths, ancestor mask, root-to-leaf retrieve rows,
per-node confidence and entropy), so routers and merged trees are small functions over trees. A tree lives
on the device of the head that drafted it (of its tokens); the verifier moves it to its own (`DraftTree.to`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from taps_ray.models.draft_head import DraftHead, KVCache


@dataclass
class DraftTree:
    """Node 0 is the root (the token the target produced last, not yet in its cache)."""

    tokens: torch.Tensor  # [T] long
    parents: torch.Tensor  # [T] long, -1 for the root; parents precede children
    depth: torch.Tensor  # [T] long, root = 0
    mask: torch.Tensor  # [T, T] bool, ancestors and self
    retrieve: torch.Tensor  # [L, Dmax] long, root-to-leaf node indices, right-padded with -1
    confidence: torch.Tensor  # [T-1] float32, cumulative path probability of each drafted node
    entropy: torch.Tensor  # [T-1] float32, entropy (nats) of the distribution each node was drawn from
    source: torch.Tensor = field(default=None)  # [T-1] long, which head drafted each node (merged trees)

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = torch.zeros(self.size - 1, dtype=torch.long, device=self.tokens.device)

    def to(self, device: torch.device | str) -> "DraftTree":
        """This tree on `device` (itself when it is there already)."""
        if self.tokens.device == torch.device(device):
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it (plain decoding's one-node tree is a chain)."""
        return bool((self.parents == torch.arange(-1, self.size - 1, device=self.parents.device)).all())

    @property
    def mean_confidence(self) -> float:
        return float(self.confidence.mean()) if self.confidence.numel() else 0.0

    @property
    def mean_entropy(self) -> float:
        return float(self.entropy.mean()) if self.entropy.numel() else 0.0


def build_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    confidence: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    source: torch.Tensor | None = None,
) -> DraftTree:
    """Derive depth, ancestor mask and retrieve rows from parent pointers (parents must precede children)."""
    size = int(tokens.numel())
    device = tokens.device
    parent_list = parents.tolist()
    if parent_list[0] != -1 or any(not (0 <= p < i) for i, p in enumerate(parent_list) if i):
        raise ValueError(f"invalid tree: node 0 must be the root and every parent must precede its child: {parent_list}")
    mask = torch.zeros(size, size, dtype=torch.bool, device="cpu")  # filled row by row on the host, moved once
    depth = [0] * size
    mask[0, 0] = True
    for node in range(1, size):
        parent = parent_list[node]
        mask[node] = mask[parent]
        mask[node, node] = True
        depth[node] = depth[parent] + 1
    is_parent = [False] * size
    for node in range(1, size):
        is_parent[parent_list[node]] = True
    leaves = [n for n in range(size) if not is_parent[n]]
    width = max(depth) + 1
    rows = []
    for leaf in leaves:
        path = mask[leaf].nonzero().flatten().tolist()  # ancestors in index order = root-to-leaf order
        rows.append(path + [-1] * (width - len(path)))
    # Lexicographic row order (-1 last): the stochastic verifier then tries siblings in drafted-rank order.
    rows.sort(key=lambda row: [r if r >= 0 else size for r in row])
    empty = torch.zeros(size - 1, dtype=torch.float32, device=device)
    return DraftTree(
        tokens=tokens.long(),
        parents=parents.long().to(device),
        depth=torch.tensor(depth, dtype=torch.long, device=device),
        mask=mask.to(device),
        retrieve=torch.tensor(rows, dtype=torch.long, device=device),
        confidence=empty.clone() if confidence is None else confidence.float().to(device),
        entropy=empty.clone() if entropy is None else entropy.float().to(device),
        source=None if source is None else source.to(device),
    )


def path_scores(tree: DraftTree) -> list[float]:
    """Per node, the smallest confidence on its path (its own for EAGLE trees and n-gram chains, whose
    cumulative confidences never grow with depth); inf for the root."""
    parents = tree.parents.tolist()
    score = [math.inf] * tree.size
    conf = tree.confidence.tolist()
    for j in range(1, tree.size):
        score[j] = min(conf[j - 1], score[parents[j]])
    return score


def ranked_nodes(tree: DraftTree) -> list[int]:
    """Drafted node indices, most confident first (`path_scores`, ties to the lower index, so a parent always
    ranks before its child); any prefix of this list is a closed subtree."""
    score = path_scores(tree)
    return sorted(range(1, tree.size), key=lambda j: (-score[j], j))


def prune_tree(tree: DraftTree, n: int) -> DraftTree:
    """The subtree of the n most confident drafted nodes (see `ranked_nodes`), in the original node order."""
    keep = sorted(ranked_nodes(tree)[: max(n, 0)])
    return subtree(tree, keep)


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The tree of the root and the drafted nodes `keep` (each kept node's parent kept too), in node order."""
    nodes = [0] + sorted(keep)
    new_index = {old: new for new, old in enumerate(nodes)}
    parents = tree.parents.tolist()
    device = tree.tokens.device
    drafted = torch.tensor(nodes[1:], dtype=torch.long, device=device) - 1
    return build_tree(
        tree.tokens[nodes],
        torch.tensor([-1] + [new_index[parents[j]] for j in nodes[1:]], device=device),
        confidence=tree.confidence[drafted],
        entropy=tree.entropy[drafted],
        source=tree.source[drafted],
    )


def root_only(root: int, device: torch.device | str) -> DraftTree:
    """The degenerate tree of plain autoregressive decoding: verify the root, accept nothing drafted."""
    return build_tree(torch.tensor([root], device=device), torch.tensor([-1], device=device))


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
    """

    embed: torch.nn.Module
    lm_head: torch.nn.Module
    vocab: torch.Tensor | None = None
    norm: torch.nn.Module | None = None

    def __post_init__(self) -> None:
        if self.vocab is None or self.norm is not None:
            self._weight = self.lm_head.weight
        else:
            self._weight = vocab_rows(self.lm_head, self.vocab)
        if self.vocab is not None:
            self.vocab = self.vocab.to(self._weight.device)  # drafted indices map to ids on the drafting device

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities over the draft vocabulary (fp32)."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        return F.log_softmax(F.linear(hidden.to(self._weight.dtype), self._weight).float(), dim=-1)

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


def head_context(head: DraftHead, ctx: DraftContext) -> DraftContext:
    """What `head` drafts with: the target's LM head (EAGLE-2, HASS) or, for an EAGLE-3 head, its own norm, LM
    head and draft vocabulary (the study's `ctx.vocab` does not apply to it); the token embedding is the target's."""
    if not head.eagle3:
        return ctx
    return DraftContext(ctx.embed, head.lm_head, head.draft_ids(), norm=head.norm)


@dataclass
class KVSlots:
    """Preallocated keys and values [N, kvh, capacity, hd] of one head (N = 1) or of a stack of N heads
    (models/stacked_head.py; every head sees the same committed inputs, so they share one length), shared
    along one sequence's states.

    Slots 0..stable-1 hold the newest stable cache written into them; a draft writes its tree's K/V after
    that and the next extension overwrites them, so drafting copies no cache. A state older than `stable`
    that extends again (a branch) gets its own copy, so no state ever sees another's K/V.
    """

    kv: KVCache
    stable: int

    @property
    def capacity(self) -> int:
        return int(self.kv[0].shape[2])


@dataclass
class HeadCache:
    """A head's (or head stack's) stable cache: K/V for draft positions 0..length-1, built from committed target
    features only."""

    slots: KVSlots | None = None
    length: int = 0

    @property
    def kv(self) -> KVCache | None:
        """The stable keys and values [N, kvh, length, hd] (views of the slots)."""
        if self.slots is None:
            return None
        keys, values = self.slots.kv
        return keys[:, :, : self.length], values[:, :, : self.length]

    def reserve(self, head: DraftHead, needed: int) -> KVSlots:
        """Slots this cache can extend in place to `needed` positions: its own, or a fresh copy when they are
        too small or a newer state has extended them already."""
        slots = self.slots
        if slots is not None and slots.stable == self.length and slots.capacity >= needed:
            return slots
        config, weight = head.config, next(head.parameters())
        shape = (head.stacked, config.num_key_value_heads, max(2 * needed, 256), config.head_dim)
        kv = (weight.new_empty(shape), weight.new_empty(shape))
        if self.length:
            kv[0][:, :, : self.length], kv[1][:, :, : self.length] = self.kv
        return KVSlots(kv, self.length)


def extend_context(
    head: DraftHead, ctx: DraftContext, cache: HeadCache, features: torch.Tensor, next_tokens: torch.Tensor,
    reserve: int = 0,
) -> tuple[torch.Tensor, HeadCache]:
    """Step A: feed (h_p, x_{p+1}) pairs of newly committed positions; returns the last output of every stacked
    head [N, d] and the new cache, whose slots hold `reserve` more positions for the tree drafted next.

    The committed tensors may come from another device (a target worker hands back CPU tensors); they move
    to the head's."""
    m = int(next_tokens.numel())
    weight = next(head.parameters())
    dtype, device, rows = weight.dtype, weight.device, head.stacked
    slots = cache.reserve(head, cache.length + m + reserve)
    positions = torch.arange(cache.length, cache.length + m, device=device).unsqueeze(0)  # broadcast over heads
    mask = torch.ones(m, cache.length + m, dtype=torch.bool, device=device).tril(diagonal=cache.length)
    out = head.step(
        ctx.embed(next_tokens.to(device).unsqueeze(0)).to(dtype).expand(rows, -1, -1),
        features.unsqueeze(0).to(device=device, dtype=dtype).expand(rows, -1, -1),
        positions,
        mask[None, None],
        slots.kv,
        cache.length,
    )
    slots.stable = cache.length + m
    return out[:, -1], HeadCache(slots=slots, length=cache.length + m)


class Candidates:
    """EAGLE-2's candidate nodes of R trees drafted side by side, one row per tree, flat in drafting order: the
    root's top_k children, then per level the top_k children of each of the top_k frontier nodes (the previous
    level's best cumulative scores). Live drafting (`draft_eagle2_trees`) and replay (decoding/replay_draft.py)
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
    node_parents = torch.where(parent_flat < 0, 0, node_of_flat.gather(1, parent_flat.clamp(min=0)))
    if (node_parents < 0).any():
        raise AssertionError("EAGLE-2 selection kept a node without its parent")
    return tokens.gather(1, selected), node_parents, scores.gather(1, selected).exp(), entropy.gather(1, selected)


def select_tree(
    root: int, n_draft: int, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, entropy: torch.Tensor
) -> DraftTree:
    """`select_nodes` of one tree's flat candidates [F], under `root`."""
    device = tokens.device
    nodes, node_parents, confidence, node_entropy = (
        t[0] for t in select_nodes(tokens[None], scores[None], parents[None], entropy[None], n_draft))
    return build_tree(
        torch.cat([torch.tensor([root], device=device), nodes]),
        torch.cat([torch.tensor([-1], device=device), node_parents]),
        confidence=confidence,
        entropy=node_entropy,
    )


@torch.no_grad()
def draft_eagle2_trees(
    head: DraftHead,
    ctx: DraftContext,
    cache: HeadCache,
    features: torch.Tensor,
    next_tokens: torch.Tensor,
    total_token: int,
    depth: int,
    top_k: int,
    min_confidence: float = 0.0,
) -> tuple[list[DraftTree], HeadCache]:
    """EAGLE-2 dynamic trees: expand the top_k best nodes per level, keep the total_token-1 best candidates.

    One tree per stacked head (`head.stacked`; one for a plain head), all drafted in one forward per level.
    `features` [m, d] are the target features of the newly committed positions ([m, k*d] fused layers for an
    EAGLE-3 head, whose deeper levels read its own outputs) and `next_tokens` [m] the tokens that follow each of
    them; the last of these is the tree's root. `ctx` is the head's (`head_context`). `min_confidence` > 0 stops
    expanding a head's tree once its best frontier node's cumulative probability falls below it: deeper nodes
    would be less likely still to be accepted (docs/algorithms.md#draft-confidence-stop).
    """
    n_draft = total_token - 1
    k = top_k
    passes = depth if n_draft > k else 0  # a tree no wider than one level needs no expansion
    hidden, cache = extend_context(head, ctx, cache, features, next_tokens, reserve=passes * k)
    root = int(next_tokens[-1])
    rows, dtype, device = head.stacked, hidden.dtype, hidden.device
    candidates = Candidates(ctx, hidden, k)
    # One mask per head for every pass: committed columns all True, tree columns = each frontier node's
    # ancestors + self.
    start = cache.length
    mask = torch.ones(rows, k, start + passes * k, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    stop_below = math.log(min_confidence) if min_confidence > 0 else -math.inf
    widths: list[int | None] = [None] * rows  # per head: its candidates when it stopped (None: never stopped)
    for level in range(passes):
        if stop_below > -math.inf:
            for n, best in enumerate(candidates.frontier_scores[:, 0].tolist()):
                if widths[n] is None and best < stop_below:
                    widths[n] = candidates.width
            if None not in widths:
                break
        end = start + (level + 1) * k
        mask[:, :, end - k : end] = eye
        out = head.step(
            ctx.embed(candidates.frontier_tokens).to(dtype),
            candidates.frontier_hidden,
            torch.full((1, k), start + level, device=device),  # broadcast over heads
            mask[:, None, :, :end],
            cache.slots.kv,
            end - k,
        )
        parent_row = candidates.expand(ctx, out)
        mask[:, :, start:end] = mask[:, :, start:end].gather(1, parent_row[:, :, None].expand(-1, -1, end - start))

    flat = candidates.flat()
    trees = [select_tree(root, n_draft, *(t[n, : widths[n]] for t in flat)) for n in range(rows)]
    return trees, cache


def draft_eagle2(
    head: DraftHead,
    ctx: DraftContext,
    cache: HeadCache,
    features: torch.Tensor,
    next_tokens: torch.Tensor,
    total_token: int,
    depth: int,
    top_k: int,
    min_confidence: float = 0.0,
) -> tuple[DraftTree, HeadCache]:
    """`draft_eagle2_trees` of one (unstacked) head: its tree and cache."""
    (tree,), cache = draft_eagle2_trees(head, ctx, cache, features, next_tokens, total_token, depth, top_k,
                                        min_confidence)
    return tree, cache
