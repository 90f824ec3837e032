"""Draft heads in the published EAGLE / EAGLE-3 checkpoint layouts, which vLLM's and SGLang's speculative
decoding load (docs/export.md): `export_head` writes one, `load_published` reads one back (or a published one).

EAGLE-3 (`eagle3`): config.json with `architectures: [LlamaForCausalLMEagle3]`, `num_hidden_layers: 1`,
`draft_vocab_size`, `target_hidden_size` and the fused layers in `eagle_config.eagle_aux_hidden_state_layer_ids`;
weights `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` (int64 offsets: target id = draft id +
d2t[draft id]) and `t2d` (bool over the target vocabulary).
EAGLE-1/2 (`eagle`, also HASS heads): config.json with `architectures: [LlamaForCausalLM]`, `num_hidden_layers: 1`
and `bias` (whether fc has one); weights `fc.*` and `layers.0.*`. Neither layout holds the target's embedding or,
for EAGLE-2, its LM head: the serving engines take them from the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from taps_ray.fsio import atomic_dir
from taps_ray.models.draft_head import CONFIG_FILE, WEIGHTS_FILE, DraftHead, DraftHeadConfig, eagle3_layers, eagle_key

Layout = Literal["eagle", "eagle3"]
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE_ARCHITECTURE = "LlamaForCausalLM"


def layout_of(head: DraftHead) -> Layout:
    return "eagle3" if head.eagle3 else "eagle"


def published_config(head: DraftHead) -> dict:
    """config.json of the head in its published layout (Llama fields plus the EAGLE ones)."""
    c = head.config
    dtype = str(next(head.parameters()).dtype).removeprefix("torch.")
    config = {
        "architectures": [EAGLE3_ARCHITECTURE if head.eagle3 else EAGLE_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "taps": {"kind": c.kind, "target": c.target, "trained_on": c.trained_on},
    }
    if head.eagle3:
        config.update({
            "draft_vocab_size": head.lm_head.out_features,
            "target_hidden_size": c.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)},
        })
    else:
        config["bias"] = c.fc_bias
    return config


def published_key(key: str, layout: Layout) -> str:
    """Our parameter name -> the published one (`layer.` is `midlayer.` in EAGLE-3, `layers.0.` in EAGLE)."""
    if key.startswith("layer."):
        return ("midlayer." if layout == "eagle3" else "layers.0.") + key[len("layer."):]
    return key


def export_head(head: DraftHead, folder: str | Path, layout: Layout | None = None) -> Path:
    """Write `head` in its published layout (config.json + model.safetensors), atomically."""
    own = layout_of(head)
    if layout is not None and layout != own:
        raise ValueError(f"a {head.config.kind} head exports in the {own!r} layout, not {layout!r}")
    tensors = {published_key(k, own): v.detach().contiguous().cpu() for k, v in head.trainable_state().items()}
    folder = Path(folder)
    with atomic_dir(folder) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(published_config(head), indent=2))
    return folder


def _our_key(key: str, eagle3: bool) -> str | None:
    if eagle3:
        return "layer." + key[len("midlayer."):] if key.startswith("midlayer.") else (
            None if key == "embed_tokens.weight" else key)
    return eagle_key(key)


def load_published(folder: str | Path, target_layers: int | None = None, dtype: torch.dtype = torch.float32,
                   **extra: object) -> DraftHead:
    """A DraftHead from an EAGLE / EAGLE-3 checkpoint folder in the published layout, loaded strictly.

    `target_layers`: the target's number of layers, needed only for an EAGLE-3 checkpoint whose config does not
    name its fused layers (the engines then use EAGLE-3's 2, L/2, L-3).
    """
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    raw = load_file(str(folder / WEIGHTS_FILE))
    eagle3 = EAGLE3_ARCHITECTURE in config.get("architectures", []) or any(k.startswith("midlayer.") for k in raw)
    tensors = {ours: v for k, v in raw.items() if (ours := _our_key(k, eagle3)) is not None}
    hidden = config["hidden_size"]
    fields = {
        "hidden_size": hidden,
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "head_dim": config.get("head_dim") or hidden // config["num_attention_heads"],
        "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": float(config.get("rope_theta", 10000.0)),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "vocab_size": config["vocab_size"],
        "hidden_act": config.get("hidden_act", "silu"),
        "fc_bias": "fc.bias" in tensors,
        **config.get("taps", {}),
        **extra,
    }
    if eagle3:
        if config.get("target_hidden_size", hidden) != hidden:
            raise ValueError(f"{folder}: a target_hidden_size other than hidden_size ({hidden}) is not supported")
        layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if layers is None:
            if target_layers is None:
                raise ValueError(f"{folder} does not name its fused target layers: pass the target's layer count")
            layers = eagle3_layers(target_layers)
        fields.update(kind="eagle3", feature_layers=list(layers),
                      draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]))
        rows = fields["draft_vocab_size"]
        tensors.setdefault("d2t", torch.zeros(rows, dtype=torch.long))
        if "t2d" not in tensors:
            t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
            t2d[torch.arange(rows) + tensors["d2t"]] = True
            tensors["t2d"] = t2d
    head = DraftHead(DraftHeadConfig(**fields))
    expected = head.trainable_state()
    wrong = {k: (tuple(v.shape), tuple(expected[k].shape)) for k, v in tensors.items()
             if k in expected and v.shape != expected[k].shape}
    if wrong:
        raise ValueError(f"{folder}: weight shapes do not match its config.json (got, expected): {wrong}")
    head.load_trainable({k: v.to(torch.float32) if v.is_floating_point() else v.to(expected[k].dtype)
                         for k, v in tensors.items()})
    return head.to(dtype).eval()
