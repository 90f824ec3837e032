"""Llama's RMSNorm, rotary embedding and gated MLP in plain torch, for the draft head.

They compute exactly what transformers' `LlamaRMSNorm`, `LlamaRotaryEmbedding` (default RoPE) and `LlamaMLP`
compute, op for op (tests/test_heads_blocks.py compares them bit for bit), with the same parameter and buffer
names, so checkpoints are unchanged. They exist because importing transformers' Llama model code pulls in
its whole modelling stack (modeling_utils, torch.distributed.tensor, ...): about 130 MB resident in every
process that drafts, which a drafter actor that holds only the head and the target's embeddings does not need.
"""

from __future__ import annotations

import torch
from torch import nn

from taps_ray.models.cpu_linear import DecodingLinear

ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU}


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by `weight` in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE: cos and sin [B,T,head_dim] of the positions [B,T], in the input's dtype.

    `inv_freq` is a non-persistent buffer as in transformers, so `.to(dtype)` rounds it the same way.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys [B,heads,T,hd] by cos/sin [B,T,hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), bias-free."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"draft heads support the activations {sorted(ACTIVATIONS)}, not {hidden_act!r}")
        self.gate_proj = DecodingLinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = DecodingLinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = DecodingLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACTIVATIONS[hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
