"""EAGLE, HASS and EAGLE-3 training objectives for the draft head (docs/algorithms.md#training-losses).

One training sample is a conversation with tokens x_0..x_{L-1}, the target's post-norm features h_0..h_{L-1}
and the target's top-K next-token probabilities. Draft position t receives (h_t + noise, x_{t+1}) and regresses
h_{t+1}; through the frozen LM head it therefore predicts x_{t+2} (docs/algorithms.md#input-shift-and-noise).

Loss-mask alignment (docs/algorithms.md#loss-mask-alignment). ``"predicted"`` (default): position t is trained when the token it
predicts, x_{t+2}, is an assistant token. ``"ref"``: the reference's unshifted mask, m[t] = mask of x_t.
Losses are normalised by the mask sum (+1e-5), never by B·T.

HASS Harmonized Context Alignment uses an additive −inf mask (causal ∧ padding) with the version-selection
rule of docs/algorithms.md#hass-harmonized-objective — not the reference's leaky multiplicative masks.

EAGLE-3 heads (docs/algorithms.md#eagle-3-heads) train on tokens only, with a training-time test: the head is
unrolled over `passes` steps, each step reading its own previous outputs as hidden inputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, field, replace
from typing import Literal

import torch
import torch.nn.functional as F

from taps_ray.config import check_head_kind
from taps_ray.machine import has_amx
from taps_ray.models.draft_head import DraftHead

MaskAlignment = Literal["predicted", "ref"]


@dataclass
class FrozenTarget:
    """The target's frozen token embedding and LM head, as [V, d] matrices in the training dtype.

    With a reduced draft vocabulary (`vocab`, EAGLE-3 style) the LM head keeps only those rows: the head is
    trained over exactly the distribution it drafts from (the target's, renormalised on the draft vocabulary),
    and the classification terms cost a fraction of the full-vocabulary ones.
    """

    embed: torch.Tensor
    lm_head: torch.Tensor
    vocab: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._draft_row = None  # target id -> lm_head row (-1 outside the draft vocabulary), built once
        if self.vocab is not None:
            device = self.embed.device
            self.vocab = self.vocab.to(device)
            self._draft_row = torch.full((int(self.embed.shape[0]),), -1, dtype=torch.long, device=device)
            self._draft_row[self.vocab] = torch.arange(self.vocab.numel(), device=device)

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype = torch.float32,
                   vocab: torch.Tensor | None = None) -> "FrozenTarget":
        embed = model.get_input_embeddings().weight.detach().to(dtype)
        lm_head = model.get_output_embeddings().weight.detach().to(dtype)
        if vocab is not None:
            lm_head = lm_head[vocab].contiguous()
        return cls(embed=embed, lm_head=lm_head, vocab=vocab)

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.lm_head.T

    def draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> rows of `lm_head` (-1 for ids outside the draft vocabulary)."""
        return token_ids if self._draft_row is None else self._draft_row[token_ids]


@dataclass
class Batch:
    """A right-padded batch of stored features. ``loss_mask`` is per token (x_t), unshifted."""

    input_ids: torch.Tensor  # [B,T] long
    loss_mask: torch.Tensor  # [B,T] float
    hidden: torch.Tensor  # [B,T,d] any float dtype (cast to the head's dtype)
    lengths: torch.Tensor  # [B] long
    topk_probs: torch.Tensor | None = None  # [B,T,K] target probabilities for x_{t+1}
    topk_ids: torch.Tensor | None = None  # [B,T,K] long
    aux: torch.Tensor | None = None  # [B,T,k*d] the target layers an EAGLE-3 head fuses

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on the head's device (stored features are collated on the CPU)."""
        return Batch(**{f.name: None if (x := getattr(self, f.name)) is None else x.to(device) for f in fields(self)})


@dataclass
class Shifted:
    """Model inputs and targets after the shift (docs/algorithms.md#input-shift-and-noise)."""

    feat_in: torch.Tensor  # [B,T,d]
    tok_in: torch.Tensor  # [B,T]
    target: torch.Tensor  # [B,T,d]
    mask: torch.Tensor  # [B,T] float loss mask aligned with the draft position
    valid: torch.Tensor  # [B,T] bool, real (non-padding) positions
    positions: torch.Tensor  # [B,T]
    topk_probs: torch.Tensor | None = None  # [B,T,K] for the token position t predicts (x_{t+2})
    topk_ids: torch.Tensor | None = None


def uniform_noise(shape: torch.Size | tuple[int, ...], lengths: torch.Tensor, std: float,
                  generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(U[0,1) − 0.5) · std · 512 / L per sample (docs/algorithms.md#input-shift-and-noise); ``lengths`` [B] are the samples' true lengths."""
    u = torch.rand(shape, generator=generator, dtype=dtype, device=lengths.device)
    scale = std * 512.0 / lengths.to(dtype).clamp(min=1)
    return (u - 0.5) * scale.view(-1, *([1] * (len(shape) - 1)))


def shift_batch(batch: Batch, noise_std: float = 0.0, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32, mask_alignment: MaskAlignment = "predicted") -> Shifted:
    hidden = batch.hidden.to(dtype)
    b, t, _ = hidden.shape
    ar = torch.arange(t, device=hidden.device)
    valid = ar[None, :] < batch.lengths[:, None]
    feat_in = hidden
    if noise_std > 0:
        feat_in = hidden + uniform_noise(hidden.shape, batch.lengths, noise_std, generator, dtype)
    tok_in = torch.zeros_like(batch.input_ids)
    tok_in[:, :-1] = batch.input_ids[:, 1:]
    # x_{t+1} exists only for t < L-1; the last real position gets the pad token 0 (docs/algorithms.md#input-shift-and-noise)
    tok_in = torch.where(ar[None, :] < (batch.lengths[:, None] - 1), tok_in, torch.zeros_like(tok_in))
    target = torch.zeros_like(hidden)
    target[:, :-1] = hidden[:, 1:]
    m = batch.loss_mask.to(dtype) * valid.to(dtype)
    if mask_alignment == "predicted":
        mask = torch.zeros_like(m)
        mask[:, :-2] = m[:, 2:]
    elif mask_alignment == "ref":
        mask = m * (ar[None, :] < (batch.lengths[:, None] - 1)).to(dtype)
    else:
        raise ValueError(f"mask_alignment must be 'predicted' or 'ref', got {mask_alignment!r}")
    topk_probs = topk_ids = None
    if batch.topk_probs is not None and batch.topk_ids is not None:
        topk_probs = torch.zeros_like(batch.topk_probs, dtype=dtype)
        topk_probs[:, :-1] = batch.topk_probs[:, 1:].to(dtype)
        topk_ids = torch.zeros_like(batch.topk_ids)
        topk_ids[:, :-1] = batch.topk_ids[:, 1:]
    positions = ar[None, :].expand(b, t)
    return Shifted(feat_in, tok_in, target, mask, valid, positions, topk_probs, topk_ids)


def causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """bool [B,1,T,T]: causal ∧ key padding (True = may attend)."""
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    return causal[None, None] & valid[:, None, None, :]


def version_index(t: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T,T] long: which feature version query row r reads at key column c (−1 where c > r), docs/algorithms.md#hass-harmonized-objective."""
    r = torch.arange(t, device=device)[:, None]
    c = torch.arange(t, device=device)[None, :]
    delta = r - c
    version = torch.where(delta <= n - 2, n - 1 - delta, torch.zeros_like(delta))
    return torch.where(delta >= 0, version, torch.full_like(delta, -1))


def hca_forward(head: DraftHead, token_embeddings: torch.Tensor, versions: list[torch.Tensor],
                positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """HASS forward over n = len(versions) feature versions (versions[0] = F0, the true features).

    Queries and the residual come from the newest version; at row r, key column c reads version
    n−1−(r−c) when r−c <= n−2 and version 0 otherwise. The selection is a boolean mask over the keys of
    all versions concatenated, so the softmax runs over exactly one version per causal column (−inf elsewhere).
    """
    n = len(versions)
    t = token_embeddings.shape[1]
    xs = [head.inputs(token_embeddings, v) for v in versions]
    newest, residual = xs[-1]
    q, k_new, v_new = head.project(newest, positions)
    if n == 1:
        return head.finish(residual, head.attend(q, k_new, v_new, causal_mask(valid)))
    keys, values = [], []
    for x, _ in xs[:-1]:
        _, k, v = head.project(x, positions)
        keys.append(k)
        values.append(v)
    keys.append(k_new)
    values.append(v_new)
    sel = version_index(t, n, valid.device)
    key_ok = valid[:, None, None, :]  # [B,1,1,T]
    mask = torch.cat([(sel == i)[None, None] & key_ok for i in range(n)], dim=-1)  # [B,1,T,n*T]
    attended = head.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
    return head.finish(residual, attended)


def resolve_precision(precision: str, device: torch.device | None = None) -> str:
    """`train.precision` as it runs: "auto" is bf16-mixed on a GPU or on a CPU with AMX, fp32 on other CPUs."""
    if precision != "auto":
        return precision
    on_gpu = device is not None and device.type != "cpu"
    return "bf16-mixed" if on_gpu or has_amx() else "fp32"


@dataclass
class LossSettings:
    reg_weight: float = 1.0
    cls_weight: float = 0.1
    topk_weight: float = 0.0
    passes: int = 1
    noise_std: float = 0.2
    mask_alignment: MaskAlignment = "predicted"
    autocast: torch.dtype | None = None  # forward passes under autocast to this dtype (train.precision)
    mask_outside_vocab: bool = False  # EAGLE-3: drop positions whose target top-1 cannot be drafted (train.ttt_outside_vocab)

    def precision(self, device: torch.device) -> torch.autocast:
        """The autocast context of the forward passes; gradients flow back into the fp32 weights."""
        return torch.autocast(device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None)

    @classmethod
    def for_kind(cls, kind: str, train: object, tree_depth: int | None = None,
                 device: torch.device | None = None) -> "LossSettings":
        """EAGLE-2: regression + soft CE, one pass. HASS: + top-K distillation and ``train.hca_passes`` passes.
        EAGLE-3: soft CE only, no input noise, ``train.ttt_steps`` training-time-test steps (None: `tree_depth`
        + 1; without a depth, as in tests of the loss alone, ``train.hca_passes``). `device`: where training runs
        (``train.precision: auto`` picks by it; None: this machine's CPU)."""
        hass = check_head_kind(kind) == "hass"
        precision = resolve_precision(getattr(train, "precision", "fp32"), device)
        autocast = torch.bfloat16 if precision == "bf16-mixed" else None
        alignment = getattr(train, "mask_alignment", "predicted")
        if kind == "eagle3":
            steps = getattr(train, "ttt_steps", None) or (tree_depth + 1 if tree_depth else train.hca_passes)
            return cls(reg_weight=0.0, cls_weight=1.0, topk_weight=0.0, passes=steps, noise_std=0.0,
                       mask_alignment=alignment, autocast=autocast,
                       mask_outside_vocab=getattr(train, "ttt_outside_vocab", "keep") == "mask")
        return cls(
            reg_weight=train.reg_weight,
            cls_weight=train.cls_weight,
            topk_weight=train.topk_weight if hass else 0.0,
            passes=train.hca_passes if hass else 1,
            noise_std=train.noise_std,
            mask_alignment=alignment,
            autocast=autocast,
        )


@dataclass
class TargetDistribution:
    """The target side of the classification terms on the masked positions (computed once per batch)."""

    index: tuple[torch.Tensor, torch.Tensor]  # (batch, time) of masked positions
    weights: torch.Tensor  # [N] mask values
    probs: torch.Tensor  # [N,V] softmax(lm_head(target))
    argmax: torch.Tensor  # [N]
    topk_probs: torch.Tensor | None  # [N,K]
    topk_ids: torch.Tensor | None
    norm: torch.Tensor  # sum(mask) + 1e-5

    @classmethod
    def build(cls, shifted: Shifted, frozen: FrozenTarget,
              precision: contextlib.AbstractContextManager | None = None) -> "TargetDistribution":
        """`precision`: the forward passes' autocast (`LossSettings.precision`). Under bf16-mixed the target's
        logits, a step's largest matmul (N x d x V: 8,192 x 4,096 x 128,256 at the paper's size), run on the
        same bf16 tensor cores as the head's; their softmax runs in fp32, so the loss moves by rounding only
        (tests/test_losses.py)."""
        index = torch.nonzero(shifted.mask, as_tuple=True)
        with torch.no_grad():
            with precision if precision is not None else contextlib.nullcontext():
                logits = frozen.logits(shifted.target[index])
            if logits.dtype in (torch.bfloat16, torch.float16):
                logits = logits.float()
            probs = torch.softmax(logits, dim=-1)
            argmax = logits.argmax(-1)
        tp = shifted.topk_probs[index] if shifted.topk_probs is not None else None
        ti = frozen.draft_index(shifted.topk_ids[index]) if shifted.topk_ids is not None else None
        if ti is not None and tp is not None:
            tp = tp * (ti >= 0)  # top-K ids outside the draft vocabulary cannot be drafted: they drop out
            ti = ti.clamp(min=0)
        return cls(index, shifted.mask[index], probs, argmax, tp, ti, shifted.mask.sum() + 1e-5)


def loss_terms(pred: torch.Tensor, shifted: Shifted, dist: TargetDistribution, frozen: FrozenTarget,
               with_topk: bool) -> dict[str, torch.Tensor]:
    """Lreg (SmoothL1 β=1, mean over d), Lcls (soft CE), Ltopk (stored top-K, not renormalised), top-1 agreement."""
    reg = F.smooth_l1_loss(pred, shifted.target, reduction="none", beta=1.0).mean(-1)
    log_q = torch.log_softmax(frozen.logits(pred[dist.index]), dim=-1)
    terms = {"reg": (reg * shifted.mask).sum() / dist.norm, **token_terms(log_q, dist)}
    if with_topk:
        if dist.topk_probs is None:
            raise ValueError("the HASS top-K loss needs stored target top-K probabilities in the batch")
        picked = log_q.gather(-1, dist.topk_ids)
        terms["topk"] = -((dist.topk_probs * picked).sum(-1) * dist.weights).sum() / dist.norm
    return terms


def token_terms(log_q: torch.Tensor, dist: TargetDistribution) -> dict[str, torch.Tensor]:
    """Lcls (soft CE against the target's distribution) and top-1 agreement of draft log-probs [N,V]."""
    terms = {"cls": -((dist.probs * log_q).sum(-1) * dist.weights).sum() / dist.norm}
    with torch.no_grad():
        agree = (log_q.argmax(-1) == dist.argmax).to(log_q.dtype)
        terms["acc"] = (agree * dist.weights).sum() / dist.norm
    return terms


@dataclass
class StepResult:
    loss: float  # sum over passes of the weighted loss
    terms: dict[str, float] = field(default_factory=dict)  # pass-0 terms, plus acc_j for every pass j
    mask_tokens: float = 0.0
    tokens: int = 0


def run_passes(head: DraftHead, batch: Batch, frozen: FrozenTarget, settings: LossSettings, *,
               backward: bool, noise: bool = True, generator: torch.Generator | None = None,
               passes: int | None = None) -> StepResult:
    """EAGLE (passes=1) or HASS HCA (passes=J) on one batch; with ``backward`` gradients accumulate per pass.

    The caller zeroes gradients before and clips/steps after. ``passes`` overrides the settings (evaluation
    uses it to measure agreement at simulated draft depth j for any head). EAGLE-3 heads run `run_ttt`.
    """
    weight = next(head.parameters())
    dtype, batch = weight.dtype, batch.to(weight.device)
    if head.eagle3:
        return run_ttt(head, batch, frozen, settings, backward=backward, passes=passes)
    shifted = shift_batch(batch, settings.noise_std if noise else 0.0, generator, dtype, settings.mask_alignment)
    dist = TargetDistribution.build(shifted, frozen, settings.precision(weight.device))
    emb = frozen.embeddings(shifted.tok_in).to(dtype)
    n_passes = passes or settings.passes
    with_topk = settings.topk_weight > 0
    versions: list[torch.Tensor] = [shifted.feat_in]
    total = 0.0
    out: dict[str, float] = {}
    for j in range(n_passes):
        with settings.precision(weight.device):
            pred = hca_forward(head, emb, versions, shifted.positions, shifted.valid)
            terms = loss_terms(pred, shifted, dist, frozen, with_topk)
            loss = settings.reg_weight * terms["reg"] + settings.cls_weight * terms["cls"]
            if with_topk:
                loss = loss + settings.topk_weight * terms["topk"]
        if backward:
            loss.backward()
        total += float(loss.detach())
        if j == 0:
            out.update({k: float(v.detach()) for k, v in terms.items()})
            out["loss0"] = float(loss.detach())
        out[f"acc_{j}"] = float(terms["acc"])
        if j + 1 < n_passes:
            prev = versions[-1]
            versions.append(torch.cat([prev[:, :1], pred[:, :-1]], dim=1).detach())
    return StepResult(loss=total, terms=out, mask_tokens=float(shifted.mask.sum()), tokens=batch.tokens)


TTT_DECAY = 0.8  # EAGLE-3 weighs the loss of training-time-test step j by 0.8**j


def _ahead(x: torch.Tensor, j: int) -> torch.Tensor:
    """x[:, t+j] at position t, zero past the end: what position t sees j draft steps later."""
    if j == 0:
        return x
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - j] = x[:, j:]
    return out


def ttt_steps(head: DraftHead, frozen: FrozenTarget, shifted: Shifted, aux: torch.Tensor, steps: int):
    """EAGLE-3's training-time test (docs/algorithms.md#eagle-3-heads): yields (step j, its Shifted, hidden [B,T,d]).

    Step 0 reads the fused target layers `aux`; step j reads step j−1's outputs at the same index t, the token
    x_{t+1+j} and predicts x_{t+2+j} at rotary position t+j, as drafting j levels deep does. Its query at t
    attends to step 0's keys at positions <= t (the committed context) and to steps 1..j's keys at t only
    (its own draft chain), so every position unrolls its own draft chain in one pass per step.
    """
    b, t = shifted.tok_in.shape
    dtype = aux.dtype
    context = causal_mask(shifted.valid)
    own = torch.eye(t, dtype=torch.bool, device=aux.device)[None, None].expand(b, 1, t, t)
    hidden = aux
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for j in range(steps):
        step = replace(shifted, tok_in=_ahead(shifted.tok_in, j), target=_ahead(shifted.target, j),
                       mask=_ahead(shifted.mask, j))
        x, residual = head.inputs(frozen.embeddings(step.tok_in).to(dtype), hidden)
        q, k, v = head.project(x, shifted.positions + j)
        keys.append(k)
        values.append(v)
        mask = torch.cat([context, *[own] * j], dim=-1)
        hidden = head.finish(residual, head.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask))
        yield j, step, hidden


def draftable_top1(shifted: Shifted, frozen: FrozenTarget, j: int) -> torch.Tensor:
    """[B,T] 1 where the target's top-1 for the token training-time-test step j predicts (x_{t+2+j}; the stored
    top-1, at the features' precision) lies in the draft vocabulary, else 0: the reference's mask (SafeAILab/EAGLE
    traineagle3), which trains a head only where drafting could propose the target's choice."""
    if shifted.topk_ids is None:
        raise ValueError("train.ttt_outside_vocab: mask needs the stored target top-K ids in the batch")
    return (frozen.draft_index(_ahead(shifted.topk_ids[..., 0], j)) >= 0).to(shifted.mask.dtype)


def run_ttt(head: DraftHead, batch: Batch, frozen: FrozenTarget, settings: LossSettings, *, backward: bool,
            passes: int | None = None) -> StepResult:
    """EAGLE-3 training on one batch: Σ_j 0.8^j · soft CE of `ttt_steps` step j through the head's own LM head
    (token-level only, no feature regression); one backward at the end."""
    if batch.aux is None:
        raise ValueError("an EAGLE-3 head trains on fused target layers: the batch has no `aux` features")
    weight = next(head.parameters())
    dtype, batch = weight.dtype, batch.to(weight.device)
    shifted = shift_batch(batch, 0.0, None, dtype, settings.mask_alignment)
    total = torch.zeros((), dtype=dtype, device=weight.device)
    out: dict[str, float] = {}
    with settings.precision(weight.device):
        for j, step, hidden in ttt_steps(head, frozen, shifted, batch.aux.to(dtype), passes or settings.passes):
            if settings.mask_outside_vocab:
                step = replace(step, mask=step.mask * draftable_top1(shifted, frozen, j))
            dist = TargetDistribution.build(step, frozen)
            log_q = torch.log_softmax(head.token_logits(hidden[dist.index]).float(), dim=-1)
            terms = token_terms(log_q, dist)
            total = total + TTT_DECAY**j * settings.cls_weight * terms["cls"]
            if j == 0:
                out.update({k: float(v.detach()) for k, v in terms.items()})
                out["loss0"] = float(terms["cls"].detach()) * settings.cls_weight
            out[f"acc_{j}"] = float(terms["acc"])
    if backward:
        total.backward()
    return StepResult(loss=float(total.detach()), terms=out, mask_tokens=float(shifted.mask.sum()),
                      tokens=batch.tokens)
