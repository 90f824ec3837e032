"""The draft head's plain-torch Llama blocks equal transformers' bit for bit, and the drafter's imports stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

from taps_ray.models.draft_head import new_head
from taps_ray.models.llama_blocks import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb

CONFIG = LlamaConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=12, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_equal_transformers_llama_blocks(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 7, CONFIG.hidden_size)
    positions = torch.arange(7).repeat(2, 1) + torch.tensor([[0], [30]])

    ours_norm, theirs_norm = RMSNorm(CONFIG.hidden_size, CONFIG.rms_norm_eps), LlamaRMSNorm(CONFIG.hidden_size, CONFIG.rms_norm_eps)
    ours_mlp, theirs_mlp = GatedMLP(CONFIG.hidden_size, CONFIG.intermediate_size, "silu"), LlamaMLP(CONFIG)
    ours_rope, theirs_rope = RotaryEmbedding(CONFIG.head_dim, 100000.0), LlamaRotaryEmbedding(CONFIG)
    for ours, theirs in ((ours_norm, theirs_norm), (ours_mlp, theirs_mlp)):
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_()
        ours.load_state_dict(theirs.state_dict())
    modules = [m.to(dtype) for m in (ours_norm, theirs_norm, ours_mlp, theirs_mlp, ours_rope, theirs_rope)]
    ours_norm, theirs_norm, ours_mlp, theirs_mlp, ours_rope, theirs_rope = modules
    x = x.to(dtype)

    assert torch.equal(ours_norm(x), theirs_norm(x))
    assert torch.equal(ours_mlp(x), theirs_mlp(x))
    cos, sin = ours_rope(x, positions)
    their_cos, their_sin = theirs_rope(x, positions)
    assert torch.equal(cos, their_cos) and torch.equal(sin, their_sin)
    q, k = torch.randn(2, 4, 7, 12, dtype=dtype), torch.randn(2, 2, 7, 12, dtype=dtype)
    for mine, theirs in zip(apply_rotary_pos_emb(q, k, cos, sin), llama_rotary(q, k, cos, sin)):
        assert torch.equal(mine, theirs)


def test_head_checkpoint_names_are_the_llama_layout() -> None:
    head = new_head(CONFIG)  # no fc bias by default, as in the published EAGLE-LLaMA3 heads
    assert sorted(head.trainable_state()) == [
        "fc.weight",
        "layer.mlp.down_proj.weight", "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight",
        "layer.post_attention_layernorm.weight",
        "layer.self_attn.k_proj.weight", "layer.self_attn.o_proj.weight", "layer.self_attn.q_proj.weight",
        "layer.self_attn.v_proj.weight",
    ]
    with pytest.raises(ValueError, match="activations"):
        GatedMLP(4, 8, "gelu_new")


def test_drafter_imports_no_transformers_model_code() -> None:
    """What a drafter actor imports (its actor module, draft parts, the evaluation loop and its cells) leaves out
    transformers' modelling stack, which only a process that holds the whole target needs, and pandas, which only
    the driver that stores results needs."""
    code = ("import sys, taps_ray.study.actors, taps_ray.models.draft_parts, taps_ray.eval.runner, taps_ray.eval.cell; "
            "print([m for m in ('transformers.modeling_utils', 'transformers.models.llama.modeling_llama', "
            "'transformers.models.llama.configuration_llama', 'transformers.models.auto.modeling_auto', 'pandas') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
