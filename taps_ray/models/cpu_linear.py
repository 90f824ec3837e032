"""Linear layers laid out for a CPU's fastest matmul kernels, for the fast target forward.

Why: at decoding sizes a CPU forward is the weights' matmuls (a 135M target at batch 1 spends ~80% of a token in
`aten::mm`), and which kernel torch picks depends on the weight's layout, not only on the shapes:
* fp32, one row (plain decoding): `x @ W^T` with W stored as [in, out] (W^T contiguous) runs faster than
  `F.linear(x, W)` over W stored [out, in] for a widening projection (gate/up ~1.2x, the LM head ~1.75x on an AMD
  EPYC), not for a narrowing one (down ~0.9x), which keeps transformers' layout; oneDNN's weight packed for 32
  rows is faster still on that EPYC, and is what one row uses where there is no AMX (`FP32_ONE_ROW_PACKED`);
* several rows (tree verification, prefill) and every bf16/fp16 matmul: oneDNN's linear over a weight reordered
  once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass
  uses) runs up to ~2.7x faster than `F.linear` (fp32 LM head at 4 rows; bf16 ~1.2-2x at 1-16 rows: without AMX
  torch's plain bf16 matmul is slower than its fp32 one).
Measured with `benchmarks/speed/cpu_linear.py` (reports/cpu_linear.md); reports/plain_decode.md and
reports/forward_width.md have the effect on decoding. The reordered
weight is a second copy (oneDNN's layout is opaque); the [in, out] layout is not: the HF model's fp32 parameters
become views of it, so transformers' forward computes with the same storage (and gets the faster one-row path
too). On a GPU, or where torch lacks oneDNN, a projection is `F.linear` over the weight as it is.
Traced by `torch.compile` (the fast forward's compiled path) a CPU projection is one opaque op, `taps::project`,
that runs the eager kernels above: oneDNN's reordered copy is an opaque tensor inductor cannot trace, and its
plain matmuls are slower at several rows; the graph passes the projection's weight and the op finds the
projection by it. The caller checks the sources before the compiled call (`check_sources`). On a GPU the graph
traces `F.linear` itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from taps_ray.machine import has_amx
from taps_ray.models.opaque_op import opaque_op


def _onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN can pack a `dtype` weight on this CPU: fp16 needs AVX512-FP16 or AVX-NE-CONVERT and bf16 AVX-512
    (oneDNN refuses the reorder otherwise); where it cannot, the projection runs unpacked (F.linear)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference-mode tensors keep none (-1: treated as never changed)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


# Whether an fp32 projection multiplies one row (plain decoding) through oneDNN's weight packed for 32 rows rather
# than a plain layout. On an AMD EPYC (AVX-512, no AMX, 2 threads) it measured faster for SmolLM2-135M's wide
# projections and slower by a few µs for its small ones (reports/cpu_linear.md: the LM head 4.0 against 4.9 ms,
# gate/up 90 against 136 µs, o 37 against 31), about 2.3 ms less a 30-layer step; Serve's engine decoding plainly
# at 1 in flight made 23.1 / 24.1 tok/s against 21.3 / 22.3 (fp32, alternating processes, ad hoc). With AMX it is
# not measured since the packing for 32 rows, so the plain [in, out] layout, measured faster than oneDNN packed for
# one row before that, stays there.
FP32_ONE_ROW_PACKED = not has_amx()

# The batch size oneDNN lays a reordered weight out for: 32, as vLLM's CPU linear asks. For 1 row (the value
# before) oneDNN keeps the plain fp32 layout; 32 blocks it for several rows. Decode step of SmolLM2-135M at batch
# 16, 2 threads (reports/decode_threads.md, Intel Xeon, no AMX): fp32 1.16x faster, bf16 1.03x; batch 1 within
# noise (fp32's one-row path does not read the packed weight).
PACKED_FOR_ROWS = 32


class Projection:
    """y = x Wᵀ + b over weights [out_i, in] of the same input, side by side (fused q/k/v, gate/up, an LM head).

    `fused(linears)` shares storage with HF modules: their parameters become views of the weight this projection
    reads, so nothing is held twice except oneDNN's reordered copy (CPU only). Built from bare tensors (an LM
    head, a draft vocabulary's rows) it lays out a copy. Copies follow their sources: an in-place change to them
    (a test scaling the embeddings, say) bumps their version counters and the copy is made again before use."""

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] = (),
                 pack_one_row: bool | None = None) -> None:
        self._sources = list(weights)
        self._source_biases = list(biases) or [None] * len(self._sources)
        first = self._sources[0]
        self.cpu = first.device.type == "cpu"
        self.in_features = first.shape[1]
        self.out_features = sum(weight.shape[0] for weight in self._sources)
        fp32 = first.dtype == torch.float32
        # one row through oneDNN's reordered weight: bf16/fp16 always, fp32 as `FP32_ONE_ROW_PACKED` says
        self._pack_one_row = not fp32 or (FP32_ONE_ROW_PACKED if pack_one_row is None else pack_one_row)
        # fp32 one row not packed, a widening projection (q/k/v, gate/up, an LM head): store [in, out], the fast
        # plain one-row layout; otherwise [out, in] as transformers does (a narrowing one, o and down, is no
        # faster as [in, out])
        unpacked = not (self._pack_one_row and _onednn_available(first.dtype))
        self.columns = self.cpu and fp32 and unpacked and self.out_features > self.in_features
        self.shared = False
        self._lay_out()

    @classmethod
    def fused(cls, linears: Sequence[nn.Linear], pack_one_row: bool | None = None) -> Projection:
        """One projection for `linears`, whose parameters then view its storage."""
        projection = cls([linear.weight for linear in linears], [linear.bias for linear in linears], pack_one_row)
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            weight = projection.weight
            view = weight[:, start : start + rows].t() if projection.columns else weight[start : start + rows]
            linear.weight = nn.Parameter(view, requires_grad=False)
            if projection.bias is not None:
                linear.bias = nn.Parameter(projection.bias[start : start + rows], requires_grad=False)
            start += rows
        projection._sources = [linear.weight for linear in linears]
        projection._source_biases = [linear.bias for linear in linears]
        projection.shared = True
        projection._versions = projection._source_versions()
        return projection

    def _lay_out(self) -> None:
        """This projection's weight and bias, copied from the sources in its layout, then packed."""
        single = len(self._sources) == 1  # read as it is where no layout is wanted (a GPU's LM head: no copy)
        weight = self._sources[0].detach() if single else torch.cat([w.detach() for w in self._sources])  # [out, in]
        has_bias = self._source_biases[0] is not None
        if not has_bias:
            self.bias = None
        else:
            self.bias = self._source_biases[0].detach() if single else torch.cat([b.detach() for b in self._source_biases])
        self.weight = weight.t().contiguous() if self.columns else weight
        _BY_WEIGHT[self.weight.data_ptr()] = self
        self._pack()

    def _pack(self) -> None:
        """oneDNN's reordered copy of the weight (CPU only), as of the sources' current versions."""
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.row_weight().contiguous(), PACKED_FOR_ROWS)
                       if self.cpu and _onednn_available(self.weight.dtype) else None)
        self._versions = self._source_versions()

    def __getstate__(self) -> dict:
        """Pickled (to a Ray actor) or deep-copied without oneDNN's opaque copy, which cannot be; it is made again
        on first use."""
        state = dict(self.__dict__)
        state["packed"], state["_versions"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _BY_WEIGHT[self.weight.data_ptr()] = self

    def _source_versions(self) -> tuple[tuple[int, int], ...]:
        """Each source's in-place version and storage: `module.to(...)` swaps a parameter's data under the same
        object without bumping its version, which the storage pointer sees."""
        sources = (*self._sources, *self._source_biases)
        return tuple((version_counter(t), t.data_ptr()) for t in sources if t is not None)

    def row_weight(self) -> torch.Tensor:
        """The weight as [out, in] (a view in the fp32 CPU layout): what `F.linear` and the checks read."""
        return self.weight.t() if self.columns else self.weight

    def check_sources(self) -> None:
        """Make the copies again if the sources changed in place since they were made; refuse a cast or move of
        shared storage."""
        if self._source_versions() != self._versions:  # the sources changed since the copies were made
            # shared storage that a `model.to(...)` replaced: the HF modules and this projection would silently
            # compute different models
            if self.shared and self._versions is not None and self._source_versions()[0][1] != self.weight.data_ptr():
                raise RuntimeError("the weights were cast or moved after their projection was built; build it "
                                   "again (models.target_forward.attach_forward for a target)")
            self._pack() if self.shared else self._lay_out()  # shared storage already holds an in-place change

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the sources were checked before the compiled call
            return _project(x, self.weight, self.columns) if self.cpu else self._multiply(x)
        self.check_sources()
        return self._multiply(x)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        rows = x.numel() // self.in_features
        if self.packed is not None and (rows > 1 or self._pack_one_row):
            flat = x.reshape(rows, self.in_features)
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            return out.view(*x.shape[:-1], self.out_features)
        if self.columns:
            out = torch.matmul(x, self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


_BY_WEIGHT: weakref.WeakValueDictionary[int, Projection] = weakref.WeakValueDictionary()  # weight storage -> projection


def _project_eagerly(x: torch.Tensor, weight: torch.Tensor, columns: bool) -> torch.Tensor:
    """The projection whose weight this is ([in, out] if `columns`), applied to x with the eager kernels (a
    compiled graph's call)."""
    return _BY_WEIGHT[weight.data_ptr()]._multiply(x)


def _projected_shape(x: torch.Tensor, weight: torch.Tensor, columns: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[1] if columns else weight.shape[0]), dtype=weight.dtype)


_project = opaque_op("project", "(Tensor x, Tensor weight, bool columns) -> Tensor", _project_eagerly,
                     _projected_shape)


_CACHED = "taps_projection"


def module_projection(linear: nn.Module) -> Projection:
    """The projection of a linear module's weight (an LM head, a draft head's layer), made once and kept on the
    module, so the target's forward and every drafter that drafts with the same LM head share one laid-out copy.
    A copy, not views: a head tied to the token embeddings must keep its [vocab, d] rows for lookups."""
    projection = linear.__dict__.get(_CACHED)
    if projection is None or projection._sources[0] is not linear.weight:  # new, or the parameter was replaced
        projection = Projection([linear.weight], [getattr(linear, "bias", None)])
        object.__setattr__(linear, _CACHED, projection)  # a plain attribute: not a submodule, not in the state dict
    return projection


class DecodingLinear(nn.Linear):
    """`nn.Linear` that, outside autograd, multiplies through its `module_projection` (made on first use, re-made
    when the weight changes): a draft head trains as any module and drafts with the fast kernels. Its parameters
    and state dict are nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return super().forward(x)
        return module_projection(self)(x)
