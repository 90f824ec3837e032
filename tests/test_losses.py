"""EAGLE / HASS loss terms against hand-computed values, and the HCA version-selection rule."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from taps_ray.models.draft_head import new_head
from taps_ray.training.losses import (
    Batch,
    FrozenTarget,
    LossSettings,
    TargetDistribution,
    causal_mask,
    hca_forward,
    loss_terms,
    run_passes,
    shift_batch,
    uniform_noise,
    version_index,
)


def tiny_head(d: int = 8, heads: int = 2, kv: int = 1, vocab: int = 11, seed: int = 0):
    config = LlamaConfig(hidden_size=d, intermediate_size=16, num_attention_heads=heads, num_key_value_heads=kv,
                         vocab_size=vocab, max_position_embeddings=64)
    head = new_head(config, seed=seed)
    # larger weights than the 0.02 init, so attention patterns actually matter in the comparisons
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    return head.double()


def test_uniform_noise_formula():
    lengths = torch.tensor([4, 128])
    got = uniform_noise((2, 3, 2), lengths, 0.2, torch.Generator().manual_seed(1))
    u = torch.rand((2, 3, 2), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(got[0], (u[0] - 0.5) * 0.2 * 512 / 4)
    assert torch.allclose(got[1], (u[1] - 0.5) * 0.2 * 512 / 128)
    assert got[0].abs().max() <= 0.5 * 0.2 * 128 + 1e-6


def test_shift_batch_inputs_targets_and_masks():
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 99, 99]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    hidden = torch.arange(2 * 5 * 1, dtype=torch.float32).view(2, 5, 1)
    probs = torch.arange(2 * 5 * 2, dtype=torch.float32).view(2, 5, 2)
    idx = torch.arange(2 * 5 * 2).view(2, 5, 2)
    batch = Batch(ids, mask, hidden, torch.tensor([5, 3]), probs, idx)
    s = shift_batch(batch)
    assert s.tok_in.tolist() == [[11, 12, 13, 14, 0], [21, 22, 0, 0, 0]]
    assert s.target[0, :, 0].tolist() == [1, 2, 3, 4, 0]
    assert s.target[1, :2, 0].tolist() == [6, 7]
    assert torch.equal(s.feat_in, hidden)
    # predicted alignment: position t is trained when x_{t+2} is an assistant token
    assert s.mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert s.valid.tolist() == [[True] * 5, [True, True, True, False, False]]
    assert torch.equal(s.topk_probs[:, :-1], probs[:, 1:]) and torch.equal(s.topk_ids[:, :-1], idx[:, 1:])
    ref = shift_batch(batch, mask_alignment="ref")  # REF: unshifted, last real position forced to 0
    assert ref.mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    noisy = shift_batch(batch, noise_std=0.2, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(noisy.feat_in, hidden) and torch.equal(noisy.target, s.target)


def test_loss_terms_hand_computed():
    # d = 2, V = 3; lm_head rows e1, e2, e1+e2
    frozen = FrozenTarget(embed=torch.zeros(3, 2, dtype=torch.float64),
                          lm_head=torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64))
    pred = torch.tensor([[[0.5, -1.0], [2.0, 0.0], [9.0, 9.0]]], dtype=torch.float64)
    target = torch.tensor([[[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    s = shift_batch(Batch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3), target, torch.tensor([3])),
                    dtype=torch.float64)
    s.feat_in, s.target, s.mask = pred, target, mask
    s.topk_probs = torch.tensor([[[0.5, 0.2], [0.7, 0.1], [0.0, 0.0]]], dtype=torch.float64)
    s.topk_ids = torch.tensor([[[2, 0], [1, 2], [0, 0]]])
    dist = TargetDistribution.build(s, frozen)
    terms = loss_terms(pred, s, dist, frozen, with_topk=True)

    def sl1(x):
        return 0.5 * x * x if abs(x) < 1 else abs(x) - 0.5

    nm = 2 + 1e-5
    reg = ((sl1(0.5) + sl1(-1.0)) / 2 + (sl1(2.0) + sl1(-1.0)) / 2) / nm
    assert terms["reg"].item() == pytest.approx(reg, rel=1e-12)

    def log_softmax(z):
        m = max(z)
        lse = m + math.log(sum(math.exp(v - m) for v in z))
        return [v - lse for v in z]

    # position 0: target logits (0,0,0) -> P uniform; pred logits (0.5,-1,-0.5)
    lq0 = log_softmax([0.5, -1.0, -0.5])
    # position 1: target logits (0,1,1) ; pred logits (2,0,2)
    lq1 = log_softmax([2.0, 0.0, 2.0])
    p1 = [math.exp(v) for v in log_softmax([0.0, 1.0, 1.0])]
    cls = -(sum(lq0) / 3 + sum(p * l for p, l in zip(p1, lq1))) / nm
    assert terms["cls"].item() == pytest.approx(cls, rel=1e-12)
    topk = -((0.5 * lq0[2] + 0.2 * lq0[0]) + (0.7 * lq1[1] + 0.1 * lq1[2])) / nm
    assert terms["topk"].item() == pytest.approx(topk, rel=1e-12)
    # argmax: pos 0 target ties -> index 0, pred argmax 0 -> agree; pos 1 target argmax 1, pred argmax 0 -> no
    assert terms["acc"].item() == pytest.approx(1 / nm, rel=1e-9)


def test_loss_terms_over_a_reduced_draft_vocabulary():
    """Draft vocabulary {0, 2} of V = 3: soft CE over the renormalised target; top-K ids outside it drop out."""
    full = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    model = torch.nn.Module()
    model.get_input_embeddings = lambda: torch.nn.Embedding(3, 2)
    model.get_output_embeddings = lambda: SimpleNamespace(weight=full)
    frozen = FrozenTarget.from_model(model, torch.float64, vocab=torch.tensor([0, 2]))
    assert frozen.draft_index(torch.tensor([0, 1, 2])).tolist() == [0, -1, 1]
    pred = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    target = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    s = shift_batch(Batch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), target, torch.tensor([2])),
                    dtype=torch.float64)
    s.feat_in, s.target, s.mask = pred, target, torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    s.topk_probs = torch.tensor([[[0.6, 0.3], [0.0, 0.0]]], dtype=torch.float64)
    s.topk_ids = torch.tensor([[[1, 2], [0, 0]]])  # token 1 is not in the draft vocabulary
    dist = TargetDistribution.build(s, frozen)
    terms = loss_terms(pred, s, dist, frozen, with_topk=True)
    nm = 1 + 1e-5
    lq = [2.0 - math.log(math.exp(2.0) + math.exp(2.0)), 2.0 - math.log(2 * math.exp(2.0))]  # logits (2, 2)
    p = [1 / (1 + math.e), math.e / (1 + math.e)]  # target logits (0, 1) over draft ids {0, 2}
    assert terms["cls"].item() == pytest.approx(-(p[0] * lq[0] + p[1] * lq[1]) / nm, rel=1e-12)
    assert terms["topk"].item() == pytest.approx(-(0.3 * lq[1]) / nm, rel=1e-12)


def test_version_index_rule():
    v = version_index(5, 3)
    expected = [
        [2, -1, -1, -1, -1],
        [1, 2, -1, -1, -1],
        [0, 1, 2, -1, -1],
        [0, 0, 1, 2, -1],
        [0, 0, 0, 1, 2],
    ]
    assert v.tolist() == expected
    one = version_index(4, 1)  # n = 1: plain causal attention over the true features
    assert torch.equal(one == 0, torch.ones(4, 4, dtype=torch.bool).tril())


def _inputs(b=2, t=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    feats = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    positions = torch.arange(t)[None].expand(b, t)
    valid = torch.arange(t)[None, :] < torch.tensor([t, t - 2])[:, None]
    return emb, feats, positions, valid


def test_hca_one_version_equals_plain_forward():
    head = tiny_head()
    emb, feats, positions, valid = _inputs()
    plain, _ = head(emb, feats, positions, causal_mask(valid))
    assert torch.allclose(hca_forward(head, emb, [feats], positions, valid), plain, atol=1e-12)


def test_hca_two_versions_manual():
    head = tiny_head()
    emb, f0, positions, valid = _inputs()
    g1 = torch.randn(f0.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = hca_forward(head, emb, [f0, g1], positions, valid)
    attn = head.layer.self_attn
    b, t, _ = f0.shape
    (x0, _), (x1, _) = head.inputs(emb, f0), head.inputs(emb, g1)
    q, k1, v1 = head.project(x1, positions)
    _, k0, v0 = head.project(x0, positions)
    groups = attn.num_heads // attn.num_kv_heads
    out = torch.zeros(b, attn.num_heads, t, attn.head_dim, dtype=torch.float64)
    for bi in range(b):
        for h in range(attn.num_heads):
            kh = h // groups
            for r in range(int(valid[bi].sum())):
                cols = list(range(r + 1))
                keys = torch.stack([(k1 if c == r else k0)[bi, kh, c] for c in cols])
                vals = torch.stack([(v1 if c == r else v0)[bi, kh, c] for c in cols])
                w = torch.softmax(keys @ q[bi, h, r] / math.sqrt(attn.head_dim), dim=0)
                out[bi, h, r] = w @ vals
    manual = head.finish(x1, out)
    for bi in range(b):
        n = int(valid[bi].sum())
        assert torch.allclose(got[bi, :n], manual[bi, :n], atol=1e-10)


def test_hca_three_versions_read_the_right_keys():
    """Output row r depends on version v at column c < r exactly when v == version(r, c) (autograd probe)."""
    head = tiny_head()
    emb, f0, positions, _ = _inputs(b=1, t=5)
    valid = torch.ones(1, 5, dtype=torch.bool)
    versions = [f0 + 10 * i for i in range(3)]  # distinct markers
    sel = version_index(5, 3)
    for r in range(5):
        vs = [v.clone().requires_grad_(True) for v in versions]
        out = hca_forward(head, emb, vs, positions, valid)
        out[0, r].sum().backward()
        for i, v in enumerate(vs):
            touched = v.grad[0].abs().sum(-1) > 0  # [T]
            for c in range(5):
                expected = bool(sel[r, c] == i) or (i == 2 and c == r)  # newest version also gives q/residual
                assert bool(touched[c]) == expected, (r, i, c)


def test_run_passes_accumulates_and_builds_versions():
    head = tiny_head(vocab=11)
    g = torch.Generator().manual_seed(3)
    frozen = FrozenTarget(embed=torch.randn(11, 8, generator=g, dtype=torch.float64),
                          lm_head=torch.randn(11, 8, generator=g, dtype=torch.float64))
    b, t, k = 2, 7, 3
    ids = torch.randint(0, 11, (b, t), generator=g)
    hidden = torch.randn(b, t, 8, generator=g, dtype=torch.float64)
    probs = torch.softmax(hidden @ frozen.lm_head.T, -1)
    top = probs.topk(k, -1)
    batch = Batch(ids, torch.ones(b, t), hidden, torch.tensor([7, 5]), top.values, top.indices)
    settings = LossSettings(topk_weight=1.0, passes=3, noise_std=0.0)
    head.zero_grad()
    result = run_passes(head, batch, frozen, settings, backward=True)
    grads = {n: p.grad.clone() for n, p in head.named_parameters()}

    # manual: three passes, versions built by shifting the previous prediction right
    s = shift_batch(batch, dtype=torch.float64)
    dist = TargetDistribution.build(s, frozen)
    emb = frozen.embeddings(s.tok_in)
    head.zero_grad()
    versions, total = [s.feat_in], 0.0
    for j in range(3):
        pred = hca_forward(head, emb, versions, s.positions, s.valid)
        terms = loss_terms(pred, s, dist, frozen, True)
        loss = terms["reg"] + 0.1 * terms["cls"] + terms["topk"]
        loss.backward()
        total += loss.item()
        versions.append(torch.cat([versions[-1][:, :1], pred[:, :-1]], 1).detach())
    assert result.loss == pytest.approx(total, rel=1e-10)
    for n, p in head.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-12), n
    assert set(result.terms) >= {"reg", "cls", "topk", "acc", "acc_0", "acc_1", "acc_2"}
    # eagle: one pass, no top-K term
    eagle = run_passes(head, batch, frozen, LossSettings(noise_std=0.0), backward=False)
    assert "topk" not in eagle.terms and "acc_1" not in eagle.terms
    assert eagle.terms["loss0"] == pytest.approx(eagle.terms["reg"] + 0.1 * eagle.terms["cls"], rel=1e-10)


def test_target_logits_under_bf16_autocast_move_the_loss_by_rounding_only():
    """bf16-mixed computes the target's logits on bf16 matmuls (softmax in fp32): the distribution and the
    soft cross-entropy stay within bf16 rounding of the fp32 ones, and the bf16 path was really taken."""
    g = torch.Generator().manual_seed(5)
    d, vocab, b, t = 64, 1000, 2, 9
    frozen = FrozenTarget(embed=torch.randn(vocab, d, generator=g), lm_head=torch.randn(vocab, d, generator=g) / 8)
    batch = Batch(torch.randint(0, vocab, (b, t), generator=g), torch.ones(b, t), torch.randn(b, t, d, generator=g),
                  torch.tensor([t, t - 2]))
    s = shift_batch(batch, dtype=torch.float32)
    exact = TargetDistribution.build(s, frozen)
    fast = TargetDistribution.build(s, frozen, LossSettings(autocast=torch.bfloat16).precision(torch.device("cpu")))
    assert fast.probs.dtype == torch.float32 and not torch.equal(fast.probs, exact.probs)
    assert torch.allclose(fast.probs, exact.probs, rtol=0.05, atol=1e-4)
    log_q = torch.log_softmax(torch.randn(exact.probs.shape, generator=g), dim=-1)
    from taps_ray.training.losses import token_terms

    cls_exact, cls_fast = token_terms(log_q, exact)["cls"], token_terms(log_q, fast)["cls"]
    assert float(cls_fast) == pytest.approx(float(cls_exact), rel=1e-2)
    assert (fast.argmax == exact.argmax).float().mean() > 0.9


def test_auto_precision_is_bf16_where_bf16_is_fast(monkeypatch):
    """`train.precision: auto`: bf16 autocast on a GPU or a CPU with AMX, fp32 on other CPUs (slower in bf16)."""
    from taps_ray.config import TrainConfig
    from taps_ray.training import losses

    for amx, cpu_precision in ((True, "bf16-mixed"), (False, "fp32")):
        monkeypatch.setattr(losses, "has_amx", lambda amx=amx: amx)
        assert losses.resolve_precision("auto") == cpu_precision
        assert losses.resolve_precision("auto", torch.device("cuda")) == "bf16-mixed"
        assert losses.resolve_precision("fp32", torch.device("cuda")) == "fp32"
        train = TrainConfig(precision="auto")
        expected = torch.bfloat16 if amx else None
        assert LossSettings.for_kind("eagle2", train, device=torch.device("cpu")).autocast == expected
