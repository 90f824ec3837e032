"""The engine's attention goes through taps_ray.models.sdpa, the one place that picks torch's kernels (cuDNN's,
which plans every new shape, is left out on CUDA), and passes masks, causality and grouped heads on unchanged."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn.functional as F

from taps_ray.models.sdpa import attention

PACKAGE = Path(__file__).resolve().parents[1] / "taps_ray"


def test_only_the_sdpa_module_calls_torch_attention():
    callers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "scaled_dot_product_attention":
                callers.append(str(path.relative_to(PACKAGE)))
    assert set(callers) == {"models/sdpa.py"}, callers


def test_attention_passes_masks_causality_and_grouped_heads():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 5, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g),
               torch.randn(2, 2, 9, 16, generator=g))
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                              attn_mask=mask, scale=0.3)
    torch.testing.assert_close(attention(q, k, v, mask=mask, scale=0.3, gqa=True), expected)
    square = k.repeat_interleave(4, 1)[:, :, :5]
    causal = attention(q, square, square, causal=True, scale=0.25)
    upper = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(causal, F.scaled_dot_product_attention(q, square, square, attn_mask=upper, scale=0.25))
    assert not torch.allclose(causal, attention(q, square, square, scale=0.25))  # causality changed the answer
