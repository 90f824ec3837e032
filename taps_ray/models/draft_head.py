"""The EAGLE draft head: fc over [token embedding; target feature] + one decoder layer of the target's shape.

The head owns only its trainable weights. The target's embedding and LM head are passed in frozen, so a
checkpoint holds no copy of them, and heads trained on different data can share one target in memory.

An EAGLE-3 head (`feature_layers` set, docs/algorithms.md#eagle-3-heads) differs in three ways: its `fc` fuses
the target's hidden states of several layers (low, mid, high: [.., k*d] -> d) instead of mixing in the token;
its layer's attention reads [norm(token embedding); norm(hidden)] (2d wide) with the hidden as residual; and it
predicts tokens through its own `norm` and `lm_head` over a reduced draft vocabulary, mapped back to target
ids by `d2t` (target id = draft id + d2t[draft id]; `t2d` marks the target ids it can draft).
The attention cache is explicit (a (key, value) tuple returned by `forward`), never a module attribute,
so two heads can draft side by side without clobbering each other.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file, save_file
from torch import nn

from taps_ray.models.cpu_linear import DecodingLinear
from taps_ray.models.kv_cache import write_slots
from taps_ray.models.llama_blocks import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb
from taps_ray.models.sdpa import attention

if TYPE_CHECKING:  # a target's config is only read here: importing its class would load transformers' model code
    from transformers import PretrainedConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def _unfold(t: torch.Tensor, sequences: int) -> torch.Tensor:
    """[B, h, S*T, hd] -> [B*S, h, T, hd]: each sequence's tokens as their own attention row."""
    b, h, st, hd = t.shape
    return t.view(b, h, sequences, st // sequences, hd).transpose(1, 2).reshape(b * sequences, h, -1, hd)


def _fold(t: torch.Tensor, sequences: int) -> torch.Tensor:
    """The inverse of `_unfold`: [B*S, h, T, hd] -> [B, h, S*T, hd]."""
    bs, h, tt, hd = t.shape
    return t.view(bs // sequences, sequences, h, tt, hd).transpose(1, 2).reshape(bs // sequences, h, -1, hd)


class DraftHeadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    vocab_size: int
    # No fc bias by default: the published EAGLE-LLaMA3 heads have none and vLLM's EAGLE fc builds none, so a
    # head trained with one would not serve there (docs/export.md). Checkpoints state theirs explicitly.
    fc_bias: bool = False
    hidden_act: str = "silu"
    kind: str = "eagle2"
    target: str = ""
    trained_on: str = ""
    feature_layers: list[int] = []  # EAGLE-3: the target's hidden_states indices fused by fc (empty: EAGLE-2 head)
    draft_vocab_size: int | None = None  # EAGLE-3: rows of the head's own LM head (None: vocab_size)

    @classmethod
    def from_target(cls, config: PretrainedConfig, **extra: object) -> "DraftHeadConfig":
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", heads),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
            vocab_size=config.vocab_size,
            hidden_act=getattr(config, "hidden_act", "silu"),
            **extra,
        )


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, mid and high target layers: the inputs of layers 2, L/2 and L-3 (`hidden_states` indices)."""
    return [min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)]


class DraftAttention(nn.Module):
    def __init__(self, config: DraftHeadConfig, input_size: int) -> None:
        super().__init__()
        d, h, kvh, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.q_proj = DecodingLinear(input_size, h * hd, bias=False)
        self.k_proj = DecodingLinear(input_size, kvh * hd, bias=False)
        self.v_proj = DecodingLinear(input_size, kvh * hd, bias=False)
        self.o_proj = DecodingLinear(h * hd, d, bias=False)


class DraftDecoderLayer(nn.Module):
    """A Llama decoder layer without the input norm (EAGLE omits it on the head's only layer)."""

    def __init__(self, config: DraftHeadConfig, attention_input: int | None = None) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, attention_input or config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Eagle3DecoderLayer(DraftDecoderLayer):
    """EAGLE-3's midlayer: attention over [input_layernorm(embedding); hidden_norm(hidden)], 2d wide."""

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__(config, attention_input=2 * config.hidden_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DraftHead(nn.Module):
    stacked: int = 1  # heads this module runs side by side, head n on batch row n (models/stacked_head.py)

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        if self.eagle3:
            self.fc = DecodingLinear(len(config.feature_layers) * d, d, bias=config.fc_bias)
            self.layer = Eagle3DecoderLayer(config)
            self.norm = RMSNorm(d, eps=config.rms_norm_eps)
            rows = config.draft_vocab_size or config.vocab_size
            self.lm_head = DecodingLinear(d, rows, bias=False)
            self.register_buffer("d2t", torch.zeros(rows, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < rows)
        else:
            self.fc = DecodingLinear(2 * d, d, bias=config.fc_bias)
            self.layer = DraftDecoderLayer(config)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    @property
    def eagle3(self) -> bool:
        return bool(self.config.feature_layers)

    # --- EAGLE-3's own vocabulary --------------------------------------------------------------------------
    def set_draft_vocab(self, vocab: torch.Tensor | None) -> None:
        """d2t/t2d from the sorted target ids of the draft vocabulary (None: the whole vocabulary)."""
        rows = self.lm_head.out_features
        ids = torch.arange(rows) if vocab is None else vocab.long().cpu()
        if ids.numel() != rows:
            raise ValueError(f"draft vocabulary of {ids.numel()} ids for an LM head of {rows} rows")
        self.d2t.copy_(ids - torch.arange(rows))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        """The target token id of every row of the head's LM head."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: logits over the draft vocabulary of the head's own hidden output."""
        return self.lm_head(self.norm(hidden))

    # The forward is split in three pieces so HASS and EAGLE-3 training can attend over several feature versions.
    def inputs(self, token_embeddings: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings [B,T,d] of the next tokens + features -> (attention input, residual).

        EAGLE-2: both are fc([embedding; feature]). EAGLE-3: the target's fused layers ([B,T,k*d]) go through fc,
        the head's own hidden outputs ([B,T,d], deeper draft steps) do not; the attention then reads
        [norm(embedding); norm(hidden)] and the residual is the hidden.
        """
        if not self.eagle3:
            x = self.fc(torch.cat([token_embeddings.to(features.dtype), features], dim=-1))
            return x, x
        hidden = features if features.shape[-1] == self.config.hidden_size else self.fc(features)
        emb = self.layer.input_layernorm(token_embeddings.to(hidden.dtype))
        return torch.cat([emb, self.layer.hidden_norm(hidden)], dim=-1), hidden

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [B,h,T,hd], keys and values [B,kvh,T,hd] at the given positions [B,T]."""
        attn = self.layer.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [B,h,T,hd], residual, then the post-norm MLP block."""
        b, _, t, _ = attended.shape
        z = residual + self.layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        return z + self.layer.mlp(self.layer.post_attention_layernorm(z))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention with grouped KV heads; `mask` is bool [B,1,T,S], True = may attend.

        SDPA's own grouping reads each KV head in place (the same numbers as repeating the heads, without the
        copy of the whole cache that repeating costs every draft pass)."""
        return attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(q.shape[-1]), gqa=q.shape[1] != k.shape[1])

    def forward(
        self,
        token_embeddings: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """Returns the predicted next features [B,T,d] and the cache extended by these T positions."""
        x, residual = self.inputs(token_embeddings, features)
        q, k, v = self.project(x, positions)
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        return self.finish(residual, self.attend(q, k, v, mask)), (k, v)

    def step(
        self,
        token_embeddings: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        kv: KVCache,
        start: int,
        sequences: int = 1,
        write_index: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` over preallocated keys and values `kv` [B,kvh,capacity,hd] (drafting): this call's K/V are
        written at slots start..start+T-1 and the attention reads slots 0..start+T-1, so a draft pass copies
        no cache. `mask` is [B,1,T,start+T]. Returns the predicted next features [B,T,d].

        `sequences` S > 1 drafts S sequences in one call: the inputs are [B, S*T, d] (each sequence's T
        tokens in turn, so every linear layer runs once for all of them), the cache and mask have B*S rows
        (row b*S + s: batch row b of sequence s) and the output is [B, S*T, d]. `write_index` [B*S, T] writes
        each row's K/V at its own slots (sequences of different lengths) instead of start..start+T-1.

        `packed` [P] (sequences of different token counts): the inputs hold only the P real tokens, `packed` their
        places in the padded S*T layout of `positions`, and so does the output [B, P, d]. The embedding mix, o_proj
        and the MLP (most of the layer's work) then skip the padding; queries, keys and values are projected and
        attend padded. A catch-up of 16 sequences after a pause (34-176 positions each) drafted in 0.67x the padded
        call's time (reports/catch_up.md)."""
        x, residual = self.inputs(token_embeddings, features)
        if packed is not None:
            x = x.new_zeros(x.shape[0], positions.shape[-1], x.shape[-1]).index_copy_(1, packed, x)
        q, k, v = self.project(x, positions)
        if sequences > 1:
            q, k, v = (_unfold(t, sequences) for t in (q, k, v))
        end = start + k.shape[2]
        if write_index is None:
            kv[0][:, :, start:end] = k
            kv[1][:, :, start:end] = v
        else:
            write_slots(kv[0], write_index, k)
            write_slots(kv[1], write_index, v)
        attended = self.attend(q, kv[0][:, :, :end], kv[1][:, :, :end], mask)
        if sequences > 1:
            attended = _fold(attended, sequences)
        if packed is not None:
            attended = attended.index_select(2, packed)
        return self.finish(residual, attended)

    # --- persistence -------------------------------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.trainable_state().items()}
        save_file(tensors, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(self.config.model_dump_json(indent=2))

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "DraftHead":
        """A saved head in `dtype` on `device` (the target's: a head drafts from the target's features)."""
        folder = Path(folder)
        if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(
                f"{folder} is not a draft-head checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
                "train one with `taps train` or point to an existing head"
            )
        config = DraftHeadConfig.model_validate_json((folder / CONFIG_FILE).read_text())
        return cls._built(config, load_file(str(folder / WEIGHTS_FILE)), dtype, device)

    @classmethod
    def from_files(cls, files: dict[str, bytes], dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> "DraftHead":
        """A head from its checkpoint's files as bytes (file name -> bytes, as a head travels through Ray's object
        store), never written to disk: a folder written for loading outlives a process that Ray kills."""
        missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in files]
        if missing:
            raise FileNotFoundError(f"a draft-head checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}; {missing} not given")
        config = DraftHeadConfig.model_validate_json(files[CONFIG_FILE])
        return cls._built(config, load_bytes(files[WEIGHTS_FILE]), dtype, device)

    @classmethod
    def _built(cls, config: DraftHeadConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               device: torch.device | str) -> "DraftHead":
        head = cls(config)
        head.load_trainable(tensors)
        return head.to(device=device, dtype=dtype)

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        """Strict load of the trainable weights (a missing or unexpected key is an error, never ignored)."""
        expected = set(self.trainable_state())
        missing, unexpected = expected - set(tensors), set(tensors) - expected
        if missing or unexpected:
            raise ValueError(f"draft-head weights do not match: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        self.load_state_dict(tensors, strict=False)


def new_head(target_config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
             draft_vocab: torch.Tensor | None = None, device: torch.device | str = "cpu",
             **extra: object) -> DraftHead:
    """A freshly initialised head shaped after the target (Llama-style init, std = initializer_range), on
    `device`; initialised on the CPU, so a seed gives the same weights on every device.

    ``kind="eagle3"`` builds an EAGLE-3 head over EAGLE-3's layers and `draft_vocab` (None: the whole vocabulary).
    """
    if extra.get("kind") == "eagle3":
        extra = {"feature_layers": eagle3_layers(target_config.num_hidden_layers),
                 "draft_vocab_size": None if draft_vocab is None else int(draft_vocab.numel()), **extra}
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        head = DraftHead(DraftHeadConfig.from_target(target_config, **extra))
        if head.eagle3:
            head.set_draft_vocab(draft_vocab)
        std = getattr(target_config, "initializer_range", 0.02)
        for module in head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    finally:
        torch.random.set_rng_state(generator_state)
    return head.to(device=device, dtype=dtype)


# --- checkpoints of the reference implementations (SafeAILab/EAGLE, HASS, TAPS) -----------------------------------

_EAGLE_DROPPED = ("embed_tokens.weight",)


def eagle_key(key: str) -> str | None:
    """Our parameter name for a key of an EAGLE/HASS draft checkpoint, or None for keys the head does not own.

    The reference head stores its single decoder layer as ``layers.0.*`` and carries a frozen copy of the
    target embedding (``embed_tokens.weight``) and sometimes RoPE buffers; those are dropped.
    """
    for prefix in ("model.", "ea_layer.", "module."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key in _EAGLE_DROPPED or key.endswith("rotary_emb.inv_freq") or key.startswith("lm_head."):
        return None
    if key.startswith("layers.0."):
        return "layer." + key[len("layers.0."):]
    if key.startswith("layers."):
        raise ValueError(f"checkpoint key {key!r}: the draft head has exactly one decoder layer (layers.0)")
    return key


def _read_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    path = Path(source)
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin", "model.pt"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise FileNotFoundError(f"{source} holds no model.safetensors or pytorch_model.bin")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def load_eagle_checkpoint(
    path_or_state_dict: str | Path | dict[str, torch.Tensor],
    target_config: PretrainedConfig,
    dtype: torch.dtype = torch.float32,
    **extra: object,
) -> DraftHead:
    """A DraftHead from an EAGLE-1/2 or HASS draft checkpoint (file, folder or state dict), loaded strictly.

    ``fc.bias`` is read from the checkpoint itself (the reference's training and inference disagree about it,
    docs/algorithms.md#draft-head); shapes must match a head built from `target_config`.
    """
    raw = path_or_state_dict if isinstance(path_or_state_dict, dict) else _read_state_dict(path_or_state_dict)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        ours = eagle_key(key)
        if ours is not None:
            tensors[ours] = value
    head = DraftHead(DraftHeadConfig.from_target(target_config, fc_bias="fc.bias" in tensors, **extra))
    expected = head.trainable_state()
    wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in tensors.items()
             if k in expected and v.shape != expected[k].shape}
    if wrong:
        raise ValueError(f"checkpoint shapes do not match the target's head (got, expected): {wrong}")
    head.load_trainable({k: v.to(torch.float32) for k, v in tensors.items()})
    return head.to(dtype)
