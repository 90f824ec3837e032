"""The engine's one call into scaled-dot-product attention, and which of torch's kernels it may take.

On CUDA the cuDNN kernel is left out. It builds an execution plan for every new shape, and the engine's shapes change
every step (the cache's key length grows, a tree's queries change with its depth): on the H200 that planning took
about 3 ms of host time per call, 113 ms per speculative step at the 8B shape with the GPU busy 17% of the time
(reports/gpu.md). Flash, memory-efficient and math kernels need no plan and take the same masks. The CPU has no
cuDNN kernel and keeps torch's own choice, without the context manager's cost.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float,
              mask: torch.Tensor | None = None, causal: bool = False, gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with the engine's kernels: `mask` bool (True = may attend) or additive,
    `causal` top-left aligned, `gqa` when the keys have fewer heads than the queries."""
    with sdpa_kernel(CUDA_BACKENDS) if queries.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
