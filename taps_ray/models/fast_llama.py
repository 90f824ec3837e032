"""taps' own forward for decoding Llama-shaped targets (Llama, Mistral, Qwen2, Qwen3): the target's verification step
without transformers' model code.

Why: transformers' eager Llama spends ~40 small ops a layer (three q/k/v matmuls, two gate/up matmuls, a mask
built per forward, `repeat_kv`, the output recorder's hooks) over a `DynamicCache` that copies itself every step,
and its matmuls take the kernel torch picks for the weight as stored, which on a CPU is not the fastest one at
decoding sizes (models/cpu_linear.py). This forward computes the same function op for op where it matters for
rounding (RMSNorm in float32, RoPE's `q*cos + rotate_half(q)*sin`, softmax inside SDPA) with
* q/k/v and gate/up each as one matmul (`cpu_linear.Projection`): the HF model's own weights are concatenated
  once and the HF parameters become views of the fused tensor, so no weight is held twice (bar oneDNN's
  reordered copy on a CPU) and transformers' forward (still used by `generate`, training and the `hf` fallback)
  computes with the very same storage;
* grouped-query attention without `repeat_kv`: the query heads sharing a key/value head are folded into the
  query length (as transformers does for one query token, here for trees too, the mask repeated to match);
* keys and values written in place into the batch's preallocated `KVCache`.
The four families differ only in what this forward reads from the HF model: Qwen2's q/k/v biases (and Llama's
optional ones) ride in the fused projections, Qwen3's per-head RMS norms of queries and keys run before RoPE as in
`Qwen3Attention`, and sliding-window layers (Mistral's `sliding_window`, Qwen's `use_sliding_window` layers) get
their window in the mask (`models/attention_windows.py`), never refused.
RoPE's inverse frequencies and scaling are read from the HF model's rotary module (so Llama-3's `llama3`
scaling, or linear scaling, is exactly HF's); rope types that change the frequencies with the position
(dynamic, longrope) are not covered and fall back to transformers (`supported`).
The hidden-state indices follow transformers': 0 the embeddings, i the output of layer i-1, the last the
post-norm output.

The compiled path (`compiled=True`, `target.compile: inductor`) runs the same two per-layer methods,
`attention_inputs` (norm, q/k/v, RoPE) and `layer_output` (o, residual, norm, gated MLP), for every layer as one
`torch.compile`d graph with the weights frozen in (models/layer_graph.py); the cache write and attention stay
eager between them, an opaque op a layer. `target.compile: step` captures the whole step over a
fixed-capacity cache instead (decoding/captured_step.py, through `decode` with its own cache write).
Attention: one additive mask per forward (`attention_masks`), none for a one-token step, and SDPA's `is_causal`
for a prefill of equal lengths, so the fused kernels can run; a one-token step on the CPU attends over each row's
own keys instead of the padded width (models/decode_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from taps_ray.models import decode_attention
from taps_ray.models.attention_windows import UnsupportedLayers, causal_mask, layer_windows, windowed_masks
from taps_ray.models.cpu_linear import Projection, module_projection
from taps_ray.models.kv_cache import KVCache
from taps_ray.models.layer_graph import LayerAttention, LayerGraph
from taps_ray.models.sdpa import attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # the inverse frequencies do not depend on the positions
CapturedMode = Literal["compile", "eager"] | None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this forward does not cover `model` (None: it does)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (covered: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if config.hidden_act not in ("silu", "swish"):
        return f"activation {config.hidden_act!r} (covered: silu)"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (covered: {', '.join(STATIC_ROPE_TYPES)})"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    try:
        layer_windows(config)
    except UnsupportedLayers as error:
        return str(error)
    return None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    q_norm: torch.Tensor | None  # Qwen3's per-head RMS norms of queries and keys (None: Llama, Mistral, Qwen2)
    k_norm: torch.Tensor | None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op: the statistics in float32, the scale in the input's dtype."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: `x.roll(half) * signed_sin` is HF's `rotate_half(x) * sin` bit for bit
    (negating is exact, so (-a)·b = a·(-b)), one roll and one multiply a layer instead of two slices, a negation,
    a concatenation and a multiply; the sign is paid once per forward."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class FastLlama:
    """The decoding forward of a transformers Llama (`LlamaForCausalLM`), sharing its weights.

    Called as the batch's target forward: (input ids [B, T], positions [B, T], a boolean mask [B, 1, T, S]
    or None for plain causal attention after the cache, the batch's `KVCache`, the hidden-state indices to
    return) -> (post-norm last layer [B, T, d], the requested hidden states concatenated, or the last layer).
    `logits(hidden)` is the LM head (the HF model's weight, laid out as the projections are), applied by the
    batch where it needs logits.
    """

    def __init__(self, model: nn.Module, compiled: bool = False, captured: CapturedMode = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"taps' fast forward does not cover this target: {reason}; use target.forward: hf")
        config = model.config
        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scaling = float(rotary.attention_scaling)
        self.windows = layer_windows(config)  # each layer's sliding window, None for full attention
        self.compiled = compiled
        self.graph = LayerGraph(self) if compiled else None
        # steps as one graph (`target.compile: step`, decoding/captured_step.py): "compile" captures it, "eager"
        # runs the same step function uncompiled (what tests compare the graph with, benchmarks count ops of)
        self.captured = captured
        self.layers = [self._layer(block) for block in inner.layers[: config.num_hidden_layers]]
        self.lm_head = module_projection(model.lm_head)
        # one-token steps on the CPU attend over each row's own keys (models/decode_attention.py), built now so
        # the first step does not wait; a captured step traces `decode` and keeps SDPA
        self.decode_kernel = captured is None and decode_attention.covers(self.embed.device, self.embed.dtype,
                                                                          self.head_dim)
        if self.decode_kernel:
            decode_attention.kernel()

    @staticmethod
    def _layer(block: nn.Module) -> _Layer:
        attn, mlp = block.self_attn, block.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(
            input_norm=block.input_layernorm.weight, qkv=Projection.fused([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=Projection.fused([attn.o_proj]), post_norm=block.post_attention_layernorm.weight,
            gate_up=Projection.fused([mlp.gate_proj, mlp.up_proj]), down=Projection.fused([mlp.down_proj]),
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
        )

    def __getstate__(self) -> dict:
        """Pickled (to a Ray actor) or deep-copied without the compiled graphs, which are bound to this object;
        the copy compiles its own (`__setstate__`)."""
        state = dict(self.__dict__)
        del state["graph"]
        state.pop("step_graphs", None)  # the captured steps (decoding/captured_step.py), bound to this object too
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.graph = LayerGraph(self) if self.compiled else None
        if self.decode_kernel:
            decode_attention.kernel()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits of post-norm hidden states [..., d] -> [..., V]."""
        return self.lm_head(hidden)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, T, head_dim] of the positions, computed as transformers' rotary module does."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and `_signed_sin` of the positions: what `attention_inputs` rotates by."""
        cos, sin = self.rope(positions, dtype)
        return cos, _signed_sin(sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, weight, self.eps)

    def attention_inputs(self, x: torch.Tensor, layer: _Layer, cos: torch.Tensor, signed_sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's queries [B, kv_heads, group*T, head_dim] (the query heads sharing a key/value head folded into
        the query length, head-major), keys and values [B, kv_heads, T, head_dim] of its input x [B, T, d];
        `signed_sin` is `_signed_sin` of the positions' sin."""
        batch, length, _ = x.shape
        h = _rms_norm(x, layer.input_norm, self.eps)
        qkv = layer.qkv(h).view(batch, length, -1, self.head_dim).transpose(1, 2)
        qk, v = qkv[:, : self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads :]
        if layer.q_norm is not None:  # Qwen3: each head's queries and keys normed over head_dim before RoPE
            qk = torch.cat([_rms_norm(qk[:, : self.heads], layer.q_norm, self.eps),
                            _rms_norm(qk[:, self.heads :], layer.k_norm, self.eps)], dim=1)
        # queries and keys rotated in one pass, element by element as HF's q*cos + rotate_half(q)*sin
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * signed_sin
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        return q.reshape(batch, self.kv_heads, (self.heads // self.kv_heads) * length, self.head_dim), k, v

    def layer_output(self, x: torch.Tensor, attended: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The layer's output [B, T, d] from its input x and its attention output (folded as the queries were)."""
        batch, length, _ = x.shape
        out = attended.reshape(batch, self.heads, length, self.head_dim).transpose(1, 2)
        x = x + layer.o(out.reshape(batch, length, self.heads * self.head_dim))
        h = _rms_norm(x, layer.post_norm, self.eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    def attention_masks(self, mask: torch.Tensor | None, positions: torch.Tensor, past: int, dtype: torch.dtype
                        ) -> tuple[dict[int | None, torch.Tensor | None], bool]:
        """Each window's additive float mask [B, 1, group*T, S] (None: no mask), built once per forward, and
        whether the attention is plainly causal (a prefill of equal lengths: no past, no mask). Why additive and
        once: SDPA turns a boolean mask into a float one at every call, that is in every layer, and a mask rules
        out the flash kernels, which a causal prefill and a one-token step (mask None) can take."""
        length = positions.shape[1]
        causal = mask is None and length > 1 and past == 0  # `is_causal`: top-left aligned, exact without a past
        if mask is None and length > 1 and past > 0:  # causal after the cache: query i sees the cache and 0..i
            mask = causal_mask(past, length, positions.device)
        masks = windowed_masks(mask, positions, past, set(self.windows))
        group = self.heads // self.kv_heads
        if group > 1 and length > 1:  # rows of the folded queries: head-major, then position
            masks = {window: m if m is None else m.repeat(1, 1, group, 1) for window, m in masks.items()}
        return {window: m if m is None else additive_mask(m, dtype) for window, m in masks.items()}, causal

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        """SDPA of folded queries; a causal prefill unfolds them (the folding would break the causal alignment)
        and lets SDPA share the key/value heads itself; a one-token step on the CPU takes the decode kernel."""
        one_token = queries.shape[2] == self.heads // self.kv_heads and (mask is None or mask.shape[2] == 1)
        kernel = decode_attention.kernel() if self.decode_kernel and one_token and not causal else None
        if kernel is not None:
            return kernel(queries, keys, values, mask, self.scale)
        if causal and mask is None:
            batch, _, rows, _ = queries.shape
            unfolded = queries.reshape(batch, self.heads, rows * self.kv_heads // self.heads, self.head_dim)
            return attention(unfolded, keys, values, causal=True, scale=self.scale, gqa=self.heads != self.kv_heads)
        return attention(queries, keys, values, mask=mask, scale=self.scale)

    def layer_attention(self, masks: dict[int | None, torch.Tensor | None], causal: bool,
                        write: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                        ) -> LayerAttention:
        """A layer's keys and values appended by `write(layer, k, v)` (which returns the keys and values to
        attend: the preallocated `KVCache` of a forward, or the fixed-capacity buffers of a captured step), then
        its attention under the forward's `masks` (`attention_masks`)."""

        def attention(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            cached_keys, cached_values = write(layer, keys, values)
            return self.attend(queries, cached_keys, cached_values, masks[self.windows[layer]], causal)

        return attention

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention,
               hidden_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers, eager, each attending through `attention` (`layer_attention`, or a packed step's); a
        captured step (decoding/captured_step.py) traces this whole."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotation(positions, x.dtype)
        wanted = {i % (self.num_layers + 1) for i in hidden_layers}
        recorded: dict[int, torch.Tensor] = {0: x} if 0 in wanted else {}
        for index, layer in enumerate(self.layers):
            queries, k, v = self.attention_inputs(x, layer, cos, sin)
            x = self.layer_output(x, attention(index, queries, k, v), layer)
            if index + 1 in wanted and index + 1 < self.num_layers:
                recorded[index + 1] = x
        last = _rms_norm(x, self.norm, self.eps)
        if not hidden_layers:
            return last, last
        recorded[self.num_layers] = last
        return last, torch.cat([recorded[i % (self.num_layers + 1)] for i in hidden_layers], dim=-1)

    def check_sources(self) -> None:
        """Lay the projections out again if their weights changed in place, and refuse a cast or move of the
        model after the forward was built: the layer graph reads its frozen weights and cannot check them, so
        its caller does, as an eager call does."""
        for layer in self.layers:
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
                projection.check_sources()
        self.lm_head.check_sources()

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: KVCache,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length = input_ids.shape
        if self.graph is not None and batch > 1 and length > 1 and self.joins_prompts:
            # several rows of trees (or chains): packed side by side into one row of the graph, as joining prompts
            last, features, _, _ = self.with_prompts(input_ids, positions, mask, cache, [], None, hidden_layers)
            return last, features
        masks, causal = self.attention_masks(mask, positions, cache.width, self.embed.dtype)
        attention = self.layer_attention(masks, causal, cache.append)
        if self.graph is not None and (length == 1 or batch == 1):
            # one-token steps, one row's step or tree and one prompt's prefill; prefills of several prompts run eager
            return self.graph(input_ids, positions, attention, hidden_layers)
        return self.decode(input_ids, positions, attention, hidden_layers)

    @property
    def joins_prompts(self) -> bool:
        """Whether `with_prompts` covers this target: not a captured step (the layer graph's forward may join: its
        packed tokens run through the graph as one prompt's prefill does), and no sliding-window layer (a prompt
        attends causally over itself there, with no window)."""
        return self.captured is None and set(self.windows) == {None}

    @torch.no_grad()
    def with_prompts(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: KVCache,
        prompts: Sequence[torch.Tensor], prompt_cache: KVCache | None, hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """A step's forward (as `__call__`) and the prefill of new sequences' `prompts` (1-D ids) in one pass: the
        step's tokens and the prompts' are packed side by side, so every projection, norm and MLP reads its weights
        once for both (vLLM's chunked prefill beside decoding, at request granularity); attention stays apart,
        the step's rows over their cache and each prompt causally over itself, its keys and values written into
        row i of `prompt_cache` (slots 0..len-1). Returns the step's (post-norm hidden [B, T, d], features) and
        each prompt's post-norm hidden and features [len, .]. Every op computes what the two separate forwards
        compute, element by element, on the same kernels but for the projections' row count. With the layer graph
        the packed tokens run through it as one row (models/layer_graph.py), as a prompt's prefill does. Without
        prompts (`prompt_cache` None) it is a step of several rows of trees through the graph (`__call__`)."""
        batch, length = input_ids.shape
        step = batch * length
        sizes = [int(p.numel()) for p in prompts]
        widest = max(sizes, default=0)
        device = input_ids.device
        ids = torch.cat([input_ids.reshape(-1), *prompts])[None]
        prompt_positions = [torch.arange(n, device=device) for n in sizes]
        packed_positions = torch.cat([positions.reshape(-1), *prompt_positions])[None]
        masks, causal = self.attention_masks(mask, positions, cache.width, self.embed.dtype)
        group = self.heads // self.kv_heads

        def step_rows(packed: torch.Tensor) -> torch.Tensor:
            """The step's keys or values [B, kv_heads, T, head_dim] of packed ones [1, kv_heads, total, head_dim]."""
            return packed[0, :, :step].reshape(self.kv_heads, batch, length, self.head_dim).transpose(0, 1)

        def attention(index: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """The step's rows over their cache, each prompt causally over itself (written into `prompt_cache`)."""
            q = queries.reshape(self.heads, k.shape[2], self.head_dim)
            q_step = q[:, :step].reshape(self.heads, batch, length, self.head_dim).transpose(0, 1)
            keys, values = cache.append(index, step_rows(k), step_rows(v))
            parts = [self.attend(q_step.reshape(batch, self.kv_heads, group * length, self.head_dim), keys, values,
                                 masks[None], causal).reshape(batch, self.heads, length, self.head_dim)
                     .transpose(0, 1).reshape(self.heads, step, self.head_dim)]
            start = step
            for row, size in enumerate(sizes):
                end = start + size
                k_row, v_row = k[:, :, start:end], v[:, :, start:end]
                prompt_cache.write_row(index, row, k_row[0], v_row[0], widest)
                q_row = q[:, start:end].reshape(1, self.kv_heads, group * size, self.head_dim)
                parts.append(self.attend(q_row, k_row, v_row, None, True)[0])
                start = end
            return torch.cat(parts, dim=1)[None]

        forward = self.graph if self.graph is not None else self.decode
        last, features = forward(ids, packed_positions, attention, hidden_layers)
        last, features = last[0], features[0]
        return (last[:step].view(batch, length, -1), features[:step].view(batch, length, -1),
                list(last[step:].split(sizes)), list(features[step:].split(sizes)))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as SDPA's additive one: 0 where True, -inf where False (the values SDPA
    converts a boolean mask to, so the attention computes the same)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
