"""transformers' forward over taps' cache on whichever transformers is installed: 5.24 takes the `Cache` as `cache`,
5.17 (the lent GPU machine's) as `past_key_values` and silently swallows `cache`, which then never writes the cache.

This file imports no pydantic, Ray or project config, so `make gpu-twin` runs it in the lent machine's twin
environment (`pytest --noconftest`) as well as in the project's: one test on each transformers version.
"""

from __future__ import annotations

import inspect

import torch
import transformers

from taps_ray.models.hf_forward import HFForward, cache_keyword
from taps_ray.models.kv_cache import KVCache


def _tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_cache_keyword_is_the_one_the_installed_decoder_takes():
    model = _tiny_llama()
    keyword = cache_keyword(model.model)
    parameters = inspect.signature(model.model.forward).parameters
    assert keyword in parameters and keyword in ("cache", "past_key_values")


def test_hf_forward_writes_the_cache_and_decodes_as_the_full_forward():
    """Prefill 12 tokens, then 3 single-token steps through the cache: each step's logits equal the full
    forward's at that position, which holds only if every step attended to the cached keys."""
    model = _tiny_llama()
    forward = HFForward(model)
    ids = torch.randint(3, 64, (1, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids).logits
    cache = KVCache(forward.num_layers)
    cache.reset(1)
    prompt = 12
    hidden, _ = forward(ids[:, :prompt], torch.arange(prompt)[None], None, cache)
    cache.advance(prompt)
    assert cache.width == prompt
    for position in range(prompt, 15):
        hidden, _ = forward(ids[:, position:position + 1], torch.tensor([[position]]), None, cache)
        cache.advance(1)
        torch.testing.assert_close(forward.logits(hidden)[0, -1], full[0, position], rtol=1e-4, atol=1e-4)
    assert cache.width == 15
