"""The CPU decode-attention kernel (taps_ray/models/decode_attention.py): builds here, computes SDPA's attention over
each row's own keys, and carries a batch's plain decoding token for token as transformers' greedy decoding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from taps_ray.decoding.generate import generate
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposers import PlainDecoding
from taps_ray.models import decode_attention
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.target_forward import attach_forward

from numerics import rounding_rtol


def _kernel() -> decode_attention.Kernel:
    kernel = decode_attention.kernel()
    assert kernel is not None, "the kernel did not build here: is g++ installed?"
    return kernel


def _case(batch: int, kv_heads: int, group: int, head_dim: int, lengths: list[int], dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Queries [B, H, group, D] and keys/values as a cache's views ([B, H, S, D] of a wider buffer), each row
    seeing its first `lengths[b]` slots and the last one (the step's own key), as a decode step's mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + 1
    queries = torch.randn(batch, kv_heads, group, head_dim, generator=g).to(dtype)
    keys, values = (torch.randn(batch, kv_heads, width + 7, head_dim, generator=g).to(dtype)[:, :, :width]
                    for _ in range(2))
    allowed = torch.zeros(batch, 1, 1, width, dtype=torch.bool)
    for row, length in enumerate(lengths):
        allowed[row, 0, 0, :length] = True
    allowed[..., -1] = True
    return queries, keys, values, allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _reference(queries, keys, values, allowed, scale) -> torch.Tensor:
    """SDPA in float64 over the padded width: the truth both kernels round."""
    return F.scaled_dot_product_attention(queries.double(), keys.double(), values.double(), attn_mask=allowed,
                                          scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(3, 3, 64), (2, 4, 128), (1, 2, 16), (2, 1, 32)])
def test_the_kernel_is_as_close_to_the_truth_as_sdpa(dtype, kv_heads, group, head_dim):
    lengths = [5, 130, 1, 77, 129]
    queries, keys, values, allowed = _case(len(lengths), kv_heads, group, head_dim, lengths, dtype)
    scale = head_dim**-0.5
    mask = _additive(allowed, dtype)
    got = _kernel()(queries, keys, values, mask, scale)
    assert got.dtype == dtype and got.shape == queries.shape
    truth = _reference(queries, keys, values, allowed, scale)
    sdpa_error = (F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale).double()
                  - truth).abs().max().item()
    # floored at one dot product's rounding (tests/numerics.py), not one eps: where SDPA rounds closer to the
    # truth (another CPU family's kernel), the kernel's own float32 sums must not fail the test
    floor = max(rounding_rtol(head_dim) * truth.abs().max().item(), torch.finfo(dtype).eps)
    assert (got.double() - truth).abs().max().item() <= 2 * max(sdpa_error, floor)
    # not vacuous: the padding holds large values, which would change the answer if attended
    unmasked = _reference(queries, keys, values, torch.ones_like(allowed), scale)
    assert (unmasked - truth).abs().max().item() > 100 * torch.finfo(dtype).eps


def test_any_mask_a_row_may_see_no_key_and_no_mask_is_every_key():
    queries, keys, values, allowed = _case(3, 2, 3, 64, [40, 40, 40], torch.float32)
    holes = allowed.clone()
    holes[0, ..., ::3] = False  # a sliding window's or any other pattern, not only a prefix
    holes[1] = False  # nothing to attend: zeros, not NaN
    got = _kernel()(queries, keys, values, _additive(holes, torch.float32), 0.125)
    torch.testing.assert_close(got[0], _reference(queries, keys, values, holes, 0.125)[0].float())
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    everything = _kernel()(queries, keys, values, None, 0.125)
    torch.testing.assert_close(everything, _reference(queries, keys, values, torch.ones_like(allowed), 0.125).float())


def test_bad_input_is_refused_with_what_was_wrong():
    queries, keys, values, allowed = _case(2, 2, 3, 64, [4, 9], torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _kernel()(queries.half(), keys.half(), values.half(), None, 0.125)
    with pytest.raises(RuntimeError, match="head size 48"):
        _kernel()(queries[..., :48], keys[..., :48], values[..., :48], None, 0.125)
    with pytest.raises(RuntimeError, match=r"wanted \[B, 1, 1, S\]"):
        _kernel()(queries, keys, values, _additive(allowed, torch.float32).expand(2, 1, 3, -1), 0.125)


def test_the_build_is_named_by_the_cpu_and_torch(monkeypatch):
    name = decode_attention.build_name()
    monkeypatch.setattr(decode_attention, "_cpu_features", lambda: "flags : sse2")
    assert decode_attention.build_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert decode_attention.build_name() != name


def test_without_a_compiler_the_forward_warns_once_and_keeps_sdpa(tmp_path):
    """In a fresh process (the kernel not yet loaded) whose build fails: one warning naming the fix, and a
    forward that still decodes, through SDPA, as transformers does."""
    script = """
import logging, torch, transformers, torch.utils.cpp_extension as extension
def no_compiler(**_): raise RuntimeError("Ninja is required to load C++ extensions")
extension.load = no_compiler
logging.basicConfig()
from taps_ray.models import decode_attention
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.target_forward import attach_forward
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
model = transformers.LlamaForCausalLM(config).eval()
forward = attach_forward(model, "fast")
assert isinstance(forward, FastLlama) and forward.decode_kernel and decode_attention.kernel() is None
from taps_ray.decoding.generate import generate
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.proposers import PlainDecoding
got = generate(model, PlainDecoding(), [[3, 4, 5, 6], [7, 8]], SamplingParams(), 6, [])
for prompt, generation in zip([[3, 4, 5, 6], [7, 8]], got):
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generation.tokens == want[0, len(prompt):].tolist()
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}  # nothing built there
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("could not be built") == 1 and "apt-get install g++ ninja-build" in run.stderr
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("lock"))  # no half-built leftovers


def test_a_build_is_moved_into_place_and_loaded_from_there_by_the_next_process(tmp_path):
    """A fresh process builds into a private directory and moves the library into the shared one; the next loads
    it from there without building (nothing can be left to wait on)."""
    script = ("import sys, time; from taps_ray.models import decode_attention as d; t = time.perf_counter(); "
              "assert d.kernel() is not None; print(time.perf_counter() - t)")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    built = list((tmp_path / "taps").iterdir())
    assert [p.name for p in built] == [f"{decode_attention.build_name()}.so"], built
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert float(second.stdout) < float(first.stdout)
    assert list((tmp_path / "taps").iterdir()) == built


def _llama(dtype: torch.dtype) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("compile_mode", ["none", "inductor"])
def test_plain_decoding_of_ragged_prompts_takes_the_kernel_and_is_greedy_token_for_token(monkeypatch, compile_mode):
    """A batch of prompts of different lengths decoded plainly: every one-token step's attention goes through the
    kernel (eager and in the layer graph), and each row's tokens are transformers' greedy ones."""
    model = _llama(torch.float32)
    forward = attach_forward(model, "fast", compile_mode)
    assert isinstance(forward, FastLlama) and forward.decode_kernel
    assert (forward.graph is not None) == (compile_mode == "inductor")
    calls = []
    kernel = _kernel()

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    monkeypatch.setattr(decode_attention, "kernel", lambda: counted)
    prompts = [list(range(3, 30)), list(range(40, 45)), list(range(50, 61))]
    generations = generate(model, PlainDecoding(), prompts, SamplingParams(), 12, [])
    assert len(calls) >= 2 * 11  # two layers, a step after the prefill's token
    assert {shape[2] for shape in calls} == {2}  # one position of the 2 query heads per key/value head
    for prompt, generation in zip(prompts, generations, strict=True):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert generation.tokens == want[0, len(prompt):].tolist()
