"""Draft heads in the published EAGLE / EAGLE-3 checkpoint layouts, which vLLM's and SGLang's speculative
decoding load (docs/export.md): `export_head` writes one for an engine, `load_published` reads one back (ours, a
published one, or one trained for either engine).

EAGLE-3 (`eagle3`): config.json with `architectures: [LlamaForCausalLMEagle3]`, `num_hidden_layers: 1`,
`draft_vocab_size`, `target_hidden_size` and the fused layers in `eagle_config.eagle_aux_hidden_state_layer_ids`;
weights `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` (int64 offsets: target id = draft id +
d2t[draft id]) and `t2d` (bool over the target vocabulary), both left out for vLLM when the draft vocabulary is the
whole vocabulary (vLLM then has no parameter for them).
EAGLE-1/2 (`eagle`, also HASS heads): config.json with `num_hidden_layers: 1`; weights `fc.*` and `layers.0.*`.
Neither layout holds the target's embedding or, for EAGLE-2, its LM head: the serving engines take them from the
target.

The engines differ in three conventions, read from their code (vLLM 0.32: models/llama_eagle.py, llama_eagle3.py,
gpu_model_runner.py; SGLang: models/llama_eagle.py, llama_eagle3.py, llama.py `set_eagle3_layers_to_capture`):
- the EAGLE class: vLLM maps `LlamaForCausalLM` to its `EagleLlamaForCausalLM`; SGLang needs `LlamaForCausalLMEagle`
  (vLLM would look for an `EagleLlamaForCausalLMEagle`, SGLang would load a plain Llama);
- the EAGLE `fc` bias: vLLM's has none, SGLang's always has one (so a bias-free head gets a zero bias there);
- the EAGLE-3 layer ids: vLLM's id i is the input of target layer i, our `hidden_states` index; SGLang captures
  the input of layer id + 1, so its ids are ours minus one (its default without ids, 2, L/2, L-3, is ours).
Both engines' Llama layers read a config key `bias` as attention bias (and SGLang's EAGLE-3 `fc` reads it too), so
no export writes it.
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
Engine = Literal["vllm", "sglang"]
ENGINES: tuple[Engine, ...] = ("vllm", "sglang")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE_ARCHITECTURES: dict[Engine, str] = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}


def engine_layer_ids(layers: list[int], engine: Engine) -> list[int]:
    """Our fused layers (`hidden_states` indices) in `engine`'s numbering of EAGLE-3's captured layers."""
    if engine == "vllm":
        return list(layers)
    if min(layers, default=1) < 1:
        raise ValueError(f"SGLang cannot capture hidden_states index 0 (the embeddings); layers {list(layers)}")
    return [i - 1 for i in layers]


def our_layer_ids(ids: list[int], engine: Engine) -> list[int]:
    """`engine_layer_ids` inverted: an engine's EAGLE-3 layer ids as our `hidden_states` indices."""
    return list(ids) if engine == "vllm" else [i + 1 for i in ids]


def _check_engine(engine: str) -> Engine:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    return engine  # type: ignore[return-value]


def layout_of(head: DraftHead) -> Layout:
    return "eagle3" if head.eagle3 else "eagle"


def published_config(head: DraftHead, engine: Engine = "vllm") -> dict:
    """config.json of the head in its published layout for `engine` (Llama fields plus the EAGLE ones)."""
    c = head.config
    dtype = str(next(head.parameters()).dtype).removeprefix("torch.")
    config = {
        "architectures": [EAGLE3_ARCHITECTURE if head.eagle3 else EAGLE_ARCHITECTURES[engine]],
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
        "taps": {"kind": c.kind, "target": c.target, "trained_on": c.trained_on, "engine": engine},
    }
    if head.eagle3:
        config.update({
            "draft_vocab_size": head.lm_head.out_features,
            "target_hidden_size": c.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(c.feature_layers, engine)},
        })
    return config


def published_key(key: str, layout: Layout) -> str:
    """Our parameter name -> the published one (`layer.` is `midlayer.` in EAGLE-3, `layers.0.` in EAGLE)."""
    if key.startswith("layer."):
        return ("midlayer." if layout == "eagle3" else "layers.0.") + key[len("layer."):]
    return key


def published_tensors(head: DraftHead, engine: Engine = "vllm") -> dict[str, torch.Tensor]:
    """The head's weights under the published names, as `engine` builds the head: an error where the engine has
    no place for a weight (an `fc` bias in vLLM, or in an EAGLE-3 head), a zero `fc.bias` where SGLang's EAGLE
    `fc` always has one."""
    layout = layout_of(head)
    tensors = {published_key(k, layout): v.detach().contiguous().cpu() for k, v in head.trainable_state().items()}
    if "fc.bias" in tensors and (engine == "vllm" or head.eagle3):
        where = ("vLLM's EAGLE and EAGLE-3 heads" if engine == "vllm"
                 else "SGLang's EAGLE-3 head (its config key `bias` would also add attention biases)")
        raise ValueError(f"this {head.config.kind} head has an fc bias, which {where} cannot hold: retrain it "
                         "without one (heads train without one by default since fc_bias became False)"
                         + ("" if head.eagle3 else ", or export it for SGLang (--engine sglang)"))
    if engine == "sglang" and not head.eagle3 and "fc.bias" not in tensors:
        tensors["fc.bias"] = torch.zeros(head.fc.out_features, dtype=head.fc.weight.dtype)
    if engine == "vllm" and head.eagle3 and head.lm_head.out_features == head.config.vocab_size:
        # the whole vocabulary: vLLM builds no draft-to-target map then, and refuses a checkpoint holding one
        # ("no module or parameter named 'draft_id_to_target_id'"); `load_published` reads its absence as identity
        del tensors["d2t"], tensors["t2d"]
    return tensors


def export_head(head: DraftHead, folder: str | Path, layout: Layout | None = None, engine: Engine = "vllm") -> Path:
    """Write `head` in its published layout for `engine` (config.json + model.safetensors), atomically."""
    own = layout_of(head)
    if layout is not None and layout != own:
        raise ValueError(f"a {head.config.kind} head exports in the {own!r} layout, not {layout!r}")
    engine = _check_engine(engine)
    tensors = published_tensors(head, engine)
    folder = Path(folder)
    with atomic_dir(folder) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(published_config(head, engine), indent=2))
    return folder


def _our_key(key: str, eagle3: bool) -> str | None:
    if eagle3:
        return "layer." + key[len("midlayer."):] if key.startswith("midlayer.") else (
            None if key == "embed_tokens.weight" else key)
    return eagle_key(key)


def checkpoint_engine(config: dict, engine: Engine | None) -> Engine:
    """Whose conventions a checkpoint follows: the one our export recorded, else SGLang's for its EAGLE class
    name, else `engine` (a SpecForge EAGLE-3 checkpoint is SGLang's but its config does not say so), else vLLM's."""
    recorded = (config.get("taps") or {}).get("engine")
    if recorded is not None:
        if engine is not None and engine != recorded:
            raise ValueError(f"the checkpoint was exported for {recorded}, not {engine}")
        return _check_engine(recorded)
    if EAGLE_ARCHITECTURES["sglang"] in config.get("architectures", []):
        if engine == "vllm":
            raise ValueError("the checkpoint's class LlamaForCausalLMEagle is SGLang's, not vLLM's")
        return "sglang"
    return _check_engine(engine or "vllm")


def load_published(folder: str | Path, target_layers: int | None = None, dtype: torch.dtype = torch.float32,
                   engine: Engine | None = None, **extra: object) -> DraftHead:
    """A DraftHead from an EAGLE / EAGLE-3 checkpoint folder in the published layout, loaded strictly.

    `engine`: the engine whose conventions the checkpoint follows (`checkpoint_engine`; it matters for the
    EAGLE-3 layer ids of a checkpoint trained for SGLang, e.g. by SpecForge). An all-zero `fc.bias` (SGLang's
    EAGLE always has one) loads as no bias. `target_layers`: the target's number of layers, needed only for an
    EAGLE-3 checkpoint whose config does not name its fused layers (both engines then use 2, L/2, L-3).
    """
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    engine = checkpoint_engine(config, engine)
    raw = load_file(str(folder / WEIGHTS_FILE))
    eagle3 = EAGLE3_ARCHITECTURE in config.get("architectures", []) or any(k.startswith("midlayer.") for k in raw)
    tensors = {ours: v for k, v in raw.items() if (ours := _our_key(k, eagle3)) is not None}
    if "fc.bias" in tensors and not torch.any(tensors["fc.bias"]):
        del tensors["fc.bias"]
    taps = {k: v for k, v in (config.get("taps") or {}).items() if k != "engine"}
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
        **taps,
        **extra,
    }
    if eagle3:
        if config.get("target_hidden_size", hidden) != hidden:
            raise ValueError(f"{folder}: a target_hidden_size other than hidden_size ({hidden}) is not supported")
        ids = config.get("eagle_aux_hidden_state_layer_ids") if engine == "vllm" else None  # vLLM reads it first
        ids = ids or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            layers = our_layer_ids(ids, engine)
        elif target_layers is None:
            raise ValueError(f"{folder} does not name its fused target layers: pass the target's layer count")
        else:
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
