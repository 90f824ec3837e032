"""Drafting over preallocated K/V slots gives, bit for bit in fp32, the trees of the plain algorithm it replaced:
every pass concatenates the cache, repeats grouped KV heads and rebuilds the tree mask (the reference below)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from taps_ray.config import TreeConfig
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, _entropy, draft_eagle2, select_tree
from taps_ray.drafting.tree import DraftTree
from taps_ray.models.draft_head import DraftHead, new_head


def _reference_forward(head: DraftHead, emb, features, positions, mask, cache):
    x, residual = head.inputs(emb, features)
    q, k, v = head.project(x, positions)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    groups = q.shape[1] // k.shape[1]
    attended = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
    return head.finish(residual, attended), (k, v)


@torch.no_grad()
def reference_draft(head, ctx, kv, length, features, next_tokens, total_token, depth, top_k):
    """EAGLE-2 as drafted before the slots: returns the tree and the new (kv, length)."""
    m = next_tokens.numel()
    mask = torch.ones(m, length + m, dtype=torch.bool).tril(diagonal=length)
    out, kv = _reference_forward(head, ctx.embed(next_tokens[None]), features[None],
                                 torch.arange(length, length + m)[None], mask[None, None], kv)
    hidden, length, k = out[0, -1], length + m, top_k
    log_p = ctx.log_probs(hidden)
    scores, tokens = log_p.topk(k)
    cand = [(tokens, scores, torch.full((k,), -1), _entropy(log_p).expand(k))]
    f_tokens, f_scores, f_hidden, f_flat = tokens, scores, hidden.expand(k, -1), torch.arange(k)
    ancestors, tree_kv = torch.eye(k, dtype=torch.bool), kv
    for level in range(depth):  # every pass, as EAGLE's topK_genrate, however small the tree
        mask = torch.cat([torch.ones(k, length, dtype=torch.bool), ancestors], dim=1)
        out, tree_kv = _reference_forward(head, ctx.embed(f_tokens[None]), f_hidden[None],
                                          torch.full((1, k), length + level), mask[None, None], tree_kv)
        log_p = ctx.log_probs(out[0])
        child_scores, child_tokens = log_p.topk(k, dim=-1)
        cumulative = (child_scores + f_scores[:, None]).flatten()
        cand.append((child_tokens.flatten(), cumulative, f_flat.repeat_interleave(k),
                     _entropy(log_p).repeat_interleave(k)))
        f_scores, best = cumulative.topk(k)
        rows = best // k
        f_tokens, f_hidden, f_flat = child_tokens.flatten()[best], out[0, rows], k + level * k * k + best
        ancestors = torch.cat([ancestors[rows], torch.eye(k, dtype=torch.bool)], dim=1)
    tree = select_tree(int(next_tokens[-1]), total_token - 1, *(torch.cat(c) for c in zip(*cand)))
    return tree, kv, length


def _draft(head, ctx, cache, features, tokens, total, depth, k, min_confidence=0.0) -> tuple[DraftTree, HeadCache]:
    """`draft_eagle2` of one sequence and one head: its tree and cache."""
    tree = TreeConfig(total_token=total, depth=depth, top_k=k, min_confidence=min_confidence)
    ((drafted,),), (cache,) = draft_eagle2(head, ctx, [cache], [features], [tokens], tree)
    return drafted, cache


def _same(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "confidence", "entropy"))


def test_drafts_equal_the_reference_bit_for_bit_over_a_sequence(tiny_target):
    torch.manual_seed(0)
    head = new_head(tiny_target.model.config, seed=3)
    ctx = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    d = head.config.hidden_size
    for total, depth, k in [(16, 4, 4), (8, 3, 2), (3, 2, 2), (4, 3, 1), (2, 3, 2)]:  # the last 3: passes skipped
        cache, kv, length = HeadCache(), None, 0
        for m in (7, 1, 3, 2, 300, 1):  # 300: the slots outgrow their first capacity
            features, tokens = torch.randn(m, d), torch.randint(0, 1000, (m,))
            tree, cache = _draft(head, ctx, cache, features, tokens, total, depth, k)
            expected, kv, length = reference_draft(head, ctx, kv, length, features, tokens, total, depth, k)
            assert _same(tree, expected), (total, depth, k, m)
            assert torch.equal(cache.kv[0], kv[0]) and torch.equal(cache.kv[1], kv[1]) and cache.length == length


def test_a_tree_too_small_for_its_depth_skips_the_passes_it_cannot_keep(tiny_target, monkeypatch):
    """A chain of 3 (total 4, top 1) drafts in 2 head passes past the root's children, not depth 3: the third
    pass's nodes would sit at depth 4 (the reference above runs every pass and gets the same trees). One more
    head call reads the committed positions."""
    head = new_head(tiny_target.model.config, seed=6)
    ctx = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    calls = []
    step = head.step
    monkeypatch.setattr(head, "step", lambda *a, **kw: calls.append(1) or step(*a, **kw))
    features, tokens = torch.randn(5, head.config.hidden_size), torch.arange(5)
    for (total, depth, k), passes in [((4, 3, 1), 2), ((16, 4, 4), 4), ((2, 4, 2), 0)]:
        calls.clear()
        tree, _ = _draft(head, ctx, HeadCache(), features, tokens, total, depth, k)
        assert len(calls) == 1 + passes and tree.size == total, (total, depth, k, len(calls))  # 1: the context
        assert TreeConfig(total_token=total, depth=depth, top_k=k).passes == passes


def test_a_state_drafted_from_twice_keeps_its_own_cache(tiny_target):
    """A branch (an older state extended again) copies the slots, so the newer state's K/V stay intact."""
    head = new_head(tiny_target.model.config, seed=4)
    ctx = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    d = head.config.hidden_size
    prompt, step, nxt = (torch.randn(6, d), torch.arange(6)), (torch.randn(2, d), torch.tensor([7, 8])), \
        (torch.randn(1, d), torch.tensor([9]))
    _, base = _draft(head, ctx, HeadCache(), *prompt, 8, 3, 2)
    _, state_a = _draft(head, ctx, base, *step, 8, 3, 2)
    _, state_b = _draft(head, ctx, base, torch.randn(3, d), torch.tensor([1, 2, 3]), 8, 3, 2)
    assert state_b.slots is not state_a.slots and state_a.slots is base.slots
    _, unbranched = _draft(head, ctx, _draft(head, ctx, HeadCache(), *prompt, 8, 3, 2)[1], *step, 8, 3, 2)
    assert torch.equal(state_a.kv[0], unbranched.kv[0]) and torch.equal(state_a.kv[1], unbranched.kv[1])
    assert _same(_draft(head, ctx, state_a, *nxt, 8, 3, 2)[0], _draft(head, ctx, unbranched, *nxt, 8, 3, 2)[0])


def test_confidence_stop_drafts_no_level_below_the_threshold(tiny_target):
    head = new_head(tiny_target.model.config, seed=5)
    ctx = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    features, tokens = torch.randn(5, head.config.hidden_size), torch.arange(5)
    full, _ = _draft(head, ctx, HeadCache(), features, tokens, 16, 4, 4)
    assert _same(_draft(head, ctx, HeadCache(), features, tokens, 16, 4, 4, min_confidence=0.0)[0], full)
    # Above every root child's confidence: no pass runs, the tree is the root's top 4 children.
    top, _ = _draft(head, ctx, HeadCache(), features, tokens, 16, 4, 4, min_confidence=0.99)
    assert top.size == 5 and int(top.depth.max()) == 1
    # Between: the levels drafted are those whose best parent clears the threshold.
    level_best = [float(full.confidence[full.depth[1:] == d].max()) for d in range(1, int(full.depth.max()) + 1)]
    cut = (level_best[0] + level_best[1]) / 2
    tree, _ = _draft(head, ctx, HeadCache(), features, tokens, 16, 4, 4, min_confidence=cut)
    assert int(tree.depth.max()) == 2 and tree.size == 16
