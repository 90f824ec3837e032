"""Linear layers laid out for a CPU's fastest matmul kernels, for the fast target forward.

Why: at decoding sizes a CPU forward is the weights' matmuls (a 135M target at batch 1 spends ~80% of a token in
`aten::mm`), and which kernel torch picks depends on the weight's layout, not only on the shapes:
* one row (plain decoding, M = 1): `x @ W^T` with W stored as [in, out] (W^T contiguous) runs ~1.3-1.8x faster
  than `F.linear(x, W)` over W stored [out, in], on the wide projections and the LM head most;
* several rows (tree verification, prefill) and every bf16/fp16 matmul: oneDNN's linear over a weight reordered
  once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass
  uses) runs ~1.2-2.5x faster than `F.linear`, in bf16 even at one row (on CPUs without AMX, torch's plain bf16
  matmul is slower than its fp32 one).
Measured with `benchmarks/cpu_linear.py`; reports/plain_decode.md has the effect on decoding. The reordered
weight is a second copy (oneDNN's layout is opaque); the [in, out] layout is not: the HF model's fp32 parameters
become views of it, so transformers' forward computes with the same storage (and gets the faster one-row path
too). On a GPU, or where torch lacks oneDNN, a projection is `F.linear` over the weight as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Projection:
    """y = x Wᵀ + b for one or several fused `nn.Linear`s of the same input (their outputs side by side).

    `share`: the HF modules' parameters become views of the weight this projection reads, so nothing is held
    twice except oneDNN's reordered copy (CPU only); otherwise (a head tied to the embeddings, which read the
    parameter by rows) the projection lays out a copy. Copies follow the parameters: an in-place change to them
    (a test scaling the embeddings, say) bumps their version counter and the copy is made again before use."""

    def __init__(self, linears: Sequence[nn.Linear], *, share: bool = True) -> None:
        self._sources = [linear.weight for linear in linears]
        self._source_biases = [linear.bias for linear in linears]
        first = self._sources[0]
        self.cpu = first.device.type == "cpu"
        self.in_features = first.shape[1]
        self.out_features = sum(weight.shape[0] for weight in self._sources)
        # fp32 on a CPU: store [in, out] (the fast one-row layout); otherwise [out, in] as transformers does
        self.columns = self.cpu and first.dtype == torch.float32
        self.share = share
        self._lay_out()
        if share:
            self._rebind(linears)

    def _lay_out(self) -> None:
        """This projection's weight and bias, copied from the sources in its layout, then packed."""
        weight = torch.cat([w.detach() for w in self._sources])  # [out, in]
        has_bias = self._source_biases[0] is not None
        self.bias = torch.cat([b.detach() for b in self._source_biases]) if has_bias else None
        self.weight = weight.t().contiguous() if self.columns else weight
        self._pack()

    def _pack(self) -> None:
        """oneDNN's reordered copy of the weight (CPU only), as of the sources' current versions."""
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.row_weight().contiguous(), 1)
                       if self.cpu and _onednn_available() else None)
        self._versions = self._source_versions()

    def _source_versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in (*self._sources, *self._source_biases) if t is not None)

    def _rebind(self, linears: Sequence[nn.Linear]) -> None:
        """The HF modules compute with this storage from now on (their versions are then this weight's)."""
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            view = self.weight[:, start : start + rows].t() if self.columns else self.weight[start : start + rows]
            linear.weight = nn.Parameter(view, requires_grad=False)
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias[start : start + rows], requires_grad=False)
            start += rows
        self._sources = [linear.weight for linear in linears]
        self._source_biases = [linear.bias for linear in linears]
        self._versions = self._source_versions()

    def row_weight(self) -> torch.Tensor:
        """The weight as [out, in] (a view in the fp32 CPU layout): what `F.linear` and the checks read."""
        return self.weight.t() if self.columns else self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._source_versions() != self._versions:  # the parameters changed in place since the copies were made
            self._pack() if self.share else self._lay_out()  # shared storage already holds the change
        rows = x.numel() // self.in_features
        if self.packed is not None and (rows > 1 or not self.columns):
            flat = x.reshape(rows, self.in_features)
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            return out.view(*x.shape[:-1], self.out_features)
        if self.columns:
            out = torch.matmul(x, self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


def lm_head_projection(lm_head: nn.Linear, tied: bool) -> Projection:
    """The target's LM head for the fast forward: shared with the HF module, or, tied to the token embeddings
    (which must keep their [vocab, d] rows for lookups), a copy laid out as the projections are."""
    return Projection([lm_head], share=not tied)
