"""The part of the target a drafter holds: input embeddings, LM head, tokenizer — never the decoder layers.

A Ray drafter drafts with the target's token embeddings and LM head (`spec.tree.DraftContext`); its heads read
the target's post-norm features, which the target worker computes, so it needs no final norm and no layer.
For a HF checkpoint only those tensors are read from the safetensors files (sharded or not; a tied LM head is
the embedding matrix), so a drafter's memory is the embedding matrix, not the whole target. The tiny random
target exists only as a seeded in-memory model: it is built, and only those modules are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers.utils import cached_file

from taps_ray.config import TargetConfig
from taps_ray.models.device import resolve_device
from taps_ray.models.target import TINY_ALIAS, Target, load_target, load_tokenizer, model_source, torch_dtype
from taps_ray.models.target import with_pad_token

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


class DraftParts(torch.nn.Module):
    """Stands in for the target model on a drafter: the two accessors `DraftContext` uses, nothing else."""

    def __init__(self, embed_tokens: torch.nn.Embedding, lm_head: torch.nn.Linear) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        """Where the drafter drafts (`Target.device` reads it as it reads a model's)."""
        return self.embed_tokens.weight.device


def read_tensors(source: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of a HF checkpoint (local folder or Hub id), reading only the shards that hold them."""
    index = cached_file(source, WEIGHTS_INDEX, _raise_exceptions_for_missing_entries=False)
    if index is None:
        files = [WEIGHTS]
    else:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = sorted({weight_map[name] for name in names if name in weight_map})
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(cached_file(source, file), "pt") as f:
            found.update({name: f.get_tensor(name) for name in names & set(f.keys())})
    return found


def tied_embeddings(source: str | Path) -> bool:
    """Whether the LM head is the embedding matrix: config.json's `tie_word_embeddings`, read as JSON because
    `AutoConfig` imports the model type's config code (~60 MB for Llama); a config without the key gets its
    model type's default from `AutoConfig` (looked up on transformers' lazy module only then)."""
    config = json.loads(Path(cached_file(source, CONFIG)).read_text())
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(getattr(transformers.AutoConfig.from_pretrained(source), "tie_word_embeddings", False))


def parts_of(embed_tokens: torch.nn.Embedding, lm_head: torch.nn.Linear) -> DraftParts:
    parts = DraftParts(embed_tokens, lm_head).eval()
    parts.requires_grad_(False)
    return parts


def load_draft_target(config: TargetConfig, dtype: str | None = None) -> Target:
    """The target as a drafter needs it (`DraftParts` for a model); `dtype` overrides the config's."""
    if config.name == TINY_ALIAS:
        whole = load_target(config, dtype)
        model = whole.model
        parts = parts_of(model.get_input_embeddings(), model.get_output_embeddings())
        return Target(parts.to(resolve_device(config)), whole.tokenizer, config.name)
    wanted = torch_dtype(dtype or config.dtype)
    source = model_source(config.name)
    tied = tied_embeddings(source)
    names = {EMBED} if tied else {EMBED, LM_HEAD}
    tensors = read_tensors(source, names)
    if names - tensors.keys():
        raise KeyError(f"target {config.name!r} has no tensors {sorted(names - tensors.keys())} in its safetensors")
    embed = torch.nn.Embedding.from_pretrained(tensors[EMBED].to(wanted), freeze=True)
    with torch.device("meta"):  # the weight is assigned below: allocate none here
        lm_head = torch.nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
    lm_head.weight = embed.weight if tied else torch.nn.Parameter(tensors[LM_HEAD].to(wanted), requires_grad=False)
    parts = parts_of(embed, lm_head).to(resolve_device(config))
    return Target(parts, with_pad_token(load_tokenizer(config.name)), config.name)
