"""transformers' own forward over the batch's preallocated `KVCache`: the fallback for targets that taps' fast
forward (`models/fast_llama.py`) does not cover, and the reference it is tested against.

transformers' attention layers write their keys and values through a `Cache`; `_CacheView` is one whose layers
write into the `KVCache` in place (instead of `DynamicCache`'s concatenation, a copy per layer per forward), so
both forwards share one cache implementation and the batch one cache invariant. Every layer is a full-attention
layer here: targets with sliding-window or linear-attention layers are refused with a clear error.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from taps_ray.models.kv_cache import KVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _KVLayer(DynamicLayer):
    """One decoder layer's view of the `KVCache`: appends in place, reports the committed width."""

    def __init__(self, cache: KVCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to initialize: the `KVCache` allocates its buffers on the first append."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.append(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.width + query_length, 0


def cache_keyword(decoder: torch.nn.Module) -> str:
    """The keyword `decoder.forward` takes its `Cache` by: `cache` since transformers 5.24, `past_key_values` before.
    Chosen by the signature, not the version string: an older forward swallows an unknown keyword in `**kwargs`,
    so passing the wrong one silently runs without the cache."""
    parameters = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{type(decoder).__name__}.forward takes neither `cache` nor `past_key_values`: this "
                    "transformers version is not supported (install transformers>=5.17)")


def _check_full_attention(model: PreTrainedModel) -> None:
    layer_types = getattr(model.config, "layer_types", None) or ()
    others = sorted({kind for kind in layer_types if kind != "full_attention"})
    if others or getattr(model.config, "use_sliding_window", False):
        raise ValueError(
            f"target {model.config.model_type!r} has {others or ['sliding_attention']} layers; taps' batch cache holds "
            "full-attention layers only (use a Llama-family target)"
        )


class HFForward:
    """The batch's target forward through transformers' model (`model.model`), same call as `FastLlama`."""

    def __init__(self, model: PreTrainedModel) -> None:
        _check_full_attention(model)
        self.model = model
        self.num_layers = model.config.num_hidden_layers
        self.cache_keyword = cache_keyword(model.model)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits of post-norm hidden states: transformers' own LM head."""
        return self.model.lm_head(hidden)

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: KVCache,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A boolean `mask` (True = may attend) is read as such by SDPA; eager attention adds a 4-D mask to the
        scores as it is, so a boolean one would mask nothing: it gets the additive form (0 or the dtype's min)."""
        if mask is not None and self.model.config._attn_implementation == "eager":
            blocked = torch.finfo(self.model.dtype).min
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(~mask, blocked)
        view = Cache(layers=[_KVLayer(cache, index) for index in range(self.num_layers)])
        out = self.model.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
            output_hidden_states=bool(hidden_layers), **{self.cache_keyword: view},
        )
        last = out.last_hidden_state
        if not hidden_layers:
            return last, last
        return last, torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)
