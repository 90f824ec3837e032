"""The fast forward's layer stack as one compiled graph (`target.compile: inductor`), its weights frozen into it.

Why one graph, and frozen: a CPU decode step at batch 4-16 spends a third of its time in about a thousand small
ops a step (norms, RoPE, residuals, the MLP's gate) dispatched one by one from Python. Inductor fuses them into a
few C++ kernels per layer, and its freezing pass (`freezing=True`) folds the weights in as constants and lays
them out for oneDNN's linear itself, as `models/cpu_linear.py` does for eager. Per-layer graphs did not pay: each
of their 60 calls a forward paid guards and a Python custom op for the projections (0.89x eager in bf16 at batch
1 and 4). One graph over every layer pays its guards once; measured on an AMD EPYC (2 threads, SmolLM2-135M,
ad hoc): a bf16 decode step 19.6 / 21.9 / 37-39.5 ms at batch 1 / 4 / 16 against eager's 24.2 / 28.0 / 44.5, fp32
35.7 / 53.4 against 38.1 / 59.6 at 4 / 16.

What stays outside the graph: the cache write and attention, one opaque op a layer (`taps::cached_attention`)
that runs the calling forward's `LayerAttention` (its cache, masks and causality) from the calling thread, so
the graph never sees the cache's width (it grows every step; a graph over it would guard on it and recompile)
nor a mask's shape. Graphs cover a step: one-token steps of 2+ rows (plain decoding; the batch dynamic,
`mark_dynamic`), one row of any tokens, its width dynamic, and a batch-1 one-token step (a graph of its own, a
batch of 1 being static: in fp32 on CPUs without AMX it runs as a row instead, `one_token_as_row`). The row is one
prompt's prefill (a 150-token bf16 prefill of SmolLM2-135M in 58-60 ms against eager's 72-73, Intel Xeon with
AMX, 2 threads, ad hoc: the time to first token of a request that finds the replica idle), a step packed with
joining prompts or with several rows' trees (`FastLlama.with_prompts`, whose attention keeps each row and prompt
apart), or one sequence's tree. Trees through the graph, against eager (reports/compiled_forward.md and
compiled_forward_bf16.md, AMD EPYC, 2 threads spinning as a replica's): one sequence's chain or tree of 4-16
nodes 1.12-1.16x in fp32 and 1.15-1.23x in bf16, four sequences' 1.01-1.04x and 1.02-1.09x. Prefills of several
prompts run eager: a batch of prompts would be one more graph to compile at start-up. Frozen weights are the
weights at compile time: `LayerGraph` rebuilds the graph when a source weight changes in place (its version
counter moves), as an eager projection lays itself out again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo import config as dynamo_config
from torch._inductor import config as inductor_config

from taps_ray.models.cpu_linear import FP32_ONE_ROW_PACKED, version_counter
from taps_ray.models.opaque_op import opaque_op


class LayeredForward(Protocol):
    """What the graph reads from the forward it compiles (`FastLlama`): its weights and its per-layer code."""

    embed: torch.Tensor
    norm: torch.Tensor
    layers: list[Any]  # each with input_norm, post_norm, q_norm, k_norm and the projections qkv, o, gate_up, down
    windows: list[int | None]

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attention_inputs(self, x: torch.Tensor, layer: Any, cos: torch.Tensor, signed_sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def layer_output(self, x: torch.Tensor, attended: torch.Tensor, layer: Any) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def check_sources(self) -> None: ...


# A layer's cache write and attention, eager between the graph's halves of the layer: (layer, queries folded
# [B, kv_heads, group*T, head_dim], keys and values [B, kv_heads, T, head_dim]) -> the attention's output, folded
# as the queries (or unfolded [B, heads, T, head_dim]: the same memory order).
LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_CALL = threading.local()  # the running graph's call: (its LayerAttention, its real token count)

# Prompt tokens a prefill through the graph is padded to a multiple of. Why: each new prompt length is a new
# row count for oneDNN's matmuls, which build their kernels for it on first use: a one-prompt bf16 prefill of
# SmolLM2-135M took ~15 ms more at a length not seen before than at one seen (~65 ms; Intel Xeon with AMX, 2
# threads, ad hoc). Padded, the lengths fall in a few widths that a replica's warm-up runs once
# (serve/warm_up.py); the padding costs 8 tokens' compute on average (~5% at 150 tokens), and the cache write
# and attention, outside the graph, see the real tokens only (`_cached_attention`).
PREFILL_BUCKET = 16
# Graphs dynamo keeps for `_LayerStack.forward` before it runs the rest eager: each forward compiles two or three
# (one-token steps of several rows, of one unless `one_token_as_row`, one row of any width), guarded on its own
# module, so a process holding a few compiled targets (tests, a copy of a replica's model) passes dynamo's 8.
GRAPHS_PER_CODE = 64


def _cached_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s cache write and attention: the calling forward's `LayerAttention`, eager. A padded call
    (`LayerGraph`) hands it its first `length` tokens only, so the cache and every real token's output are the
    unpadded call's; the padding's rows attend to nothing (zeros)."""
    attention, length = _CALL.forward
    shape, padded = queries.shape, keys.shape[2]
    if length < padded:  # the folded queries' rows are head-major, then position: keep each head's first `length`
        batch, kv_heads, rows, head_dim = shape
        queries = queries.view(batch, kv_heads, rows // padded, padded, head_dim)[:, :, :, :length]
        queries = queries.reshape(batch, kv_heads, rows // padded * length, head_dim)
        keys, values = keys[:, :, :length], values[:, :, :length]
    attended = attention(layer, queries, keys, values)
    if length < padded:  # per query head: its `length` rows, then the padding's
        attended = F.pad(attended.reshape(batch, -1, length, head_dim), (0, 0, 0, padded - length))
    return attended.reshape(shape)  # a causal prefill attends unfolded: the same rows, folded back


def _attention_shape(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(queries)


cached_attention = opaque_op("cached_attention", "(Tensor queries, Tensor keys, Tensor values, int layer) -> Tensor",
                             _cached_attention, _attention_shape)


class _Linear(nn.Module):
    """y = x Wᵀ + b over parameters viewing the fast forward's fused weights: what inductor's freezing folds."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _parameter(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


class _FrozenLayer(nn.Module):
    """One layer's weights as module parameters, with the fields `FastLlama.attention_inputs` and `layer_output`
    read from a layer (so the graph computes the eager methods' own code)."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.input_norm, self.post_norm = _parameter(layer.input_norm), _parameter(layer.post_norm)
        self.q_norm, self.k_norm = _parameter(layer.q_norm), _parameter(layer.k_norm)
        for name in ("qkv", "o", "gate_up", "down"):
            projection = getattr(layer, name)
            setattr(self, name, _Linear(projection.row_weight(), projection.bias))


class _LayerStack(nn.Module):
    """Embedding, every layer and the final norm of a fast forward, as one module for `torch.compile`."""

    def __init__(self, fast: LayeredForward) -> None:
        super().__init__()
        self.fast = [fast]  # a list: the forward's methods are code, not a submodule whose state the graph owns
        self.embed, self.norm = _parameter(fast.embed), _parameter(fast.norm)
        self.layers = nn.ModuleList(_FrozenLayer(layer) for layer in fast.layers)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        fast = self.fast[0]
        x = F.embedding(input_ids, self.embed)
        recorded = {0: x}
        for index, layer in enumerate(self.layers):
            queries, keys, values = fast.attention_inputs(x, layer, cos, signed_sin)
            attended = cached_attention(queries, keys, values, index)
            x = fast.layer_output(x, attended, layer)
            recorded[index + 1] = x
        last = fast.rms_norm(x, self.norm)
        if not hidden_layers:
            return last, last
        recorded[len(self.layers)] = last
        return last, torch.cat([recorded[i % (len(self.layers) + 1)] for i in hidden_layers], dim=-1)


class LayerGraph:
    """The compiled layer stack of one fast forward: built on first call, rebuilt when a weight changed in place."""

    def __init__(self, fast: LayeredForward) -> None:
        self.fast = fast
        self._compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._versions: tuple[int, ...] = ()

    def _sources(self) -> list[torch.Tensor]:
        """The tensors the graph folds in; the HF parameters are views of these, sharing their version counters."""
        fast = self.fast
        tensors = [fast.embed, fast.norm]
        for layer in fast.layers:
            tensors += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) if t is not None]
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
                tensors += [t for t in (projection.weight, projection.bias) if t is not None]
        return tensors

    def _current_versions(self) -> tuple[int, ...]:
        return tuple(version_counter(tensor) for tensor in self._sources())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention,
                 hidden_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over ids and positions [B, T], each attending through `attention`: one-token steps (T = 1)
        of 2+ rows, or one row (B = 1) of any tokens (a one-row step, a tree, a prefill, a step packed with trees or
        joining prompts), padded to `prefill_width`; returns the post-norm last layer and the `hidden_layers` (as
        `decode`)."""
        self.fast.check_sources()
        versions = self._current_versions()
        if self._compiled is None or versions != self._versions:
            self._compiled = torch.compile(_LayerStack(self.fast))
            self._versions = versions
        length = input_ids.shape[1]
        batch = input_ids.shape[0]
        if batch > 1 and length > 1:
            raise ValueError(f"the layer graph runs several tokens in one row only, got {batch} rows")
        one_row = batch == 1 and (length > 1 or self.one_token_as_row())
        if one_row:  # padded after its tokens (the last token and position, repeated)
            pad = self.prefill_width(length) - length
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, pad)], dim=1)
            positions = torch.cat([positions, positions[:, -1:].expand(-1, pad)], dim=1)
        cos, signed_sin = self.fast.rotation(positions, self.fast.embed.dtype)
        if batch > 1:  # a batch of one-token steps: ids [B, 1], cos and sin [B, 1, 1, head_dim]
            for tensor in (input_ids, cos, signed_sin):
                torch._dynamo.mark_dynamic(tensor, 0)
        if one_row:  # one graph for every width of a row
            torch._dynamo.mark_dynamic(input_ids, 1)
            for tensor in (cos, signed_sin):
                torch._dynamo.mark_dynamic(tensor, 2)
        _CALL.forward = (attention, length)
        try:  # inductor reads `freezing` when it compiles, which a call may do (a new shape); options= does not set it
            with inductor_config.patch(freezing=True), dynamo_config.patch(recompile_limit=GRAPHS_PER_CODE):
                last, features = self._compiled(input_ids, cos, signed_sin, tuple(hidden_layers))
        finally:
            _CALL.forward = None
        return (last, features) if length == input_ids.shape[1] else (last[:, :length], features[:, :length])

    def one_token_as_row(self) -> bool:
        """Whether a batch-1 one-token step runs as a row padded to 2 rather than through a graph of its own (a
        static batch of 1: inductor packs the weights for one row). In fp32 where one-row matmuls run faster
        through weights packed for 32 rows (`FP32_ONE_ROW_PACKED`: CPUs without AMX): Serve's engine, plain, 1 in
        flight, AMD EPYC, ad hoc, 4 alternating runs: 25.0-26.8 tok/s against 21.7-24.8; in bf16 the graph of its
        own ran faster (43.1-47.1 against 40.3-42.1), as it stays."""
        return FP32_ONE_ROW_PACKED and self.fast.embed.dtype == torch.float32

    @staticmethod
    def prefill_width(length: int) -> int:
        """The width a row of `length` tokens runs at through the graph: the next power of two from 2 up to
        `PREFILL_BUCKET` (a tree of 4 nodes pays for 4 rows, not 16; a dynamic width cannot be 1, which dynamo
        specialises), else `PREFILL_BUCKET`'s next multiple."""
        if length <= PREFILL_BUCKET:
            return max(2, 1 << (length - 1).bit_length())
        return -(-length // PREFILL_BUCKET) * PREFILL_BUCKET
