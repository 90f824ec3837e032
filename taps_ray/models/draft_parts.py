"""The part of the target a drafter holds: input embeddings, LM head, tokenizer — never the decoder layers.

Training on cached features needs the same parts (`load_training_target`): the features are the target's
post-norm hidden states, so the head trains against the embeddings and LM head alone, and a Tune trial never
holds the 8B decoder layers (16 GB at the paper's size) on its GPU or in host memory.

A Ray drafter drafts with the target's token embeddings and LM head (`spec.tree.DraftContext`); its heads read
the target's post-norm features, which the target worker computes, so it needs no final norm and no layer.
For a HF checkpoint only those tensors come from the safetensors files (sharded or not; a tied LM head is the
embedding matrix). On the CPU they are memory-mapped, not read (`MappedMatrix`): an embedding lookup reads the
rows of the tokens it embeds and a reduced draft vocabulary reads its rows of the LM head, each cast to the
drafting dtype as `Tensor.to` casts the whole matrix, so a drafter keeps resident only the draft-vocabulary head
(or the whole head, cast, when it drafts over the full vocabulary). On other devices the tensors are read and
moved there whole. The tiny random target exists only as a seeded in-memory model: it is built, and only those
modules are kept.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers.utils import cached_file

from taps_ray.config import TINY_TARGETS, TargetConfig
from taps_ray.models.device import resolve_device
from taps_ray.models.target import Target, load_target, load_tokenizer, model_source, torch_dtype
from taps_ray.models.target import with_pad_token

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' names


class MappedMatrix:
    """One 2-D tensor of a safetensors file, mapped rather than read, cast to `dtype` row by row when read.

    After each read the mapping's pages are handed back (`MADV_DONTNEED`): the kernel maps a fault's neighbours
    too (~64 KB around each row), so pages kept mapped would grow towards the whole file-dtype matrix. The rows
    read are copies, so dropping the pages never changes them."""

    def __init__(self, file: Path, name: str, dtype: torch.dtype) -> None:
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            entry = json.loads(handle.read(size))[name]
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # private: torch wants it writable
        file_dtype, (start, end) = FILE_DTYPES[entry["dtype"]], entry["data_offsets"]
        count = (end - start) // file_dtype.itemsize
        self._source = torch.frombuffer(self._map, dtype=file_dtype, count=count, offset=8 + size + start)
        self._source = self._source.view(entry["shape"])
        self.dtype = dtype
        self._whole: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, their rows): the last `rows_of`

    @property
    def shape(self) -> torch.Size:
        return self._source.shape

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` (any shape), cast: `F.embedding` over the cast matrix, without casting the rest."""
        if self._whole is not None:
            return F.embedding(ids, self._whole)
        rows = F.embedding(ids, self._source).to(self.dtype)
        self._map.madvise(mmap.MADV_DONTNEED)
        return rows

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """`rows(ids)`, kept: every draft context over the same vocabulary shares one resident copy."""
        if self._rows is None or not torch.equal(self._rows[0], ids):
            self._rows = (ids.clone(), self.rows(ids))
        return self._rows[1]

    def whole(self) -> torch.Tensor:
        """The whole matrix, cast, read once and kept (a head over the full vocabulary reads every row)."""
        if self._whole is None:
            self._whole = self._source.to(self.dtype, copy=True)
            self._map.madvise(mmap.MADV_DONTNEED)
        return self._whole


class MappedEmbedding(torch.nn.Module):
    """The input embeddings over a `MappedMatrix`: the same vectors as `nn.Embedding` over the cast matrix."""

    def __init__(self, matrix: MappedMatrix) -> None:
        super().__init__()
        self.matrix = matrix
        self.num_embeddings, self.embedding_dim = matrix.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(ids)


class MappedHead(torch.nn.Module):
    """The LM head over a `MappedMatrix`: `rows` for a draft vocabulary (`DraftContext`), `weight` for all."""

    def __init__(self, matrix: MappedMatrix) -> None:
        super().__init__()
        self.matrix = matrix

    @property
    def weight(self) -> torch.Tensor:
        return self.matrix.whole()

    def rows(self, vocab: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows_of(vocab)


class DraftParts(torch.nn.Module):
    """Stands in for the target model on a drafter: the two accessors `DraftContext` uses, the dtype and device
    it drafts in (`Target.dtype`, `Target.device`), nothing else."""

    def __init__(self, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device, config: transformers.PretrainedConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.dtype = dtype
        self._device = device
        self.config = config  # the target model's config: the shapes a new head is built with (training)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        """Where the drafter drafts (`Target.device` reads it as it reads a model's)."""
        return self._device


def tensor_files(source: str | Path, names: set[str]) -> dict[str, Path]:
    """The safetensors file of each of `names` found in a HF checkpoint (local folder or Hub id), sharded or not."""
    index = cached_file(source, WEIGHTS_INDEX, _raise_exceptions_for_missing_entries=False)
    if index is None:
        weight_map = dict.fromkeys(names, WEIGHTS)
    else:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    found: dict[str, Path] = {}
    for file in sorted({weight_map[name] for name in names if name in weight_map}):
        path = Path(cached_file(source, file))
        with safe_open(path, "pt") as f:
            found.update(dict.fromkeys(names & set(f.keys()), path))
    return found


def read_tensors(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    """The tensors named in `files`, read whole."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            found.update({name: f.get_tensor(name) for name, where in files.items() if where == path})
    return found


def tied_embeddings(source: str | Path) -> bool:
    """Whether the LM head is the embedding matrix: config.json's `tie_word_embeddings`, read as JSON because
    `AutoConfig` imports the model type's config code (~60 MB for Llama); a config without the key gets its
    model type's default from `AutoConfig` (looked up on transformers' lazy module only then)."""
    config = json.loads(Path(cached_file(source, CONFIG)).read_text())
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(getattr(transformers.AutoConfig.from_pretrained(source), "tie_word_embeddings", False))


def parts_of(embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, dtype: torch.dtype,
             device: torch.device, config: transformers.PretrainedConfig | None = None) -> DraftParts:
    parts = DraftParts(embed_tokens, lm_head, dtype, device, config).eval()
    parts.requires_grad_(False)
    return parts


def mapped_parts(files: dict[str, Path], tied: bool, dtype: torch.dtype) -> DraftParts:
    """CPU draft parts over the checkpoint's mapped files (one matrix when the LM head is tied)."""
    embed = MappedMatrix(files[EMBED], EMBED, dtype)
    head = embed if tied else MappedMatrix(files[LM_HEAD], LM_HEAD, dtype)
    return parts_of(MappedEmbedding(embed), MappedHead(head), dtype, torch.device("cpu"))


def read_parts(files: dict[str, Path], tied: bool, dtype: torch.dtype, device: torch.device,
               config: transformers.PretrainedConfig | None = None) -> DraftParts:
    """Draft parts read whole, cast and moved to `device` (a GPU: host memory is not what it spares)."""
    tensors = read_tensors(files)
    embed = torch.nn.Embedding.from_pretrained(tensors[EMBED].to(dtype), freeze=True)
    with torch.device("meta"):  # the weight is assigned below: allocate none here
        lm_head = torch.nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
    lm_head.weight = embed.weight if tied else torch.nn.Parameter(tensors[LM_HEAD].to(dtype), requires_grad=False)
    return parts_of(embed, lm_head, dtype, device, config).to(device)


def load_draft_target(config: TargetConfig, dtype: str | None = None) -> Target:
    """The target as a drafter needs it (`DraftParts` for a model); `dtype` overrides the config's."""
    device = resolve_device(config)
    if config.name in TINY_TARGETS:
        whole = load_target(config, dtype)
        model = whole.model
        parts = parts_of(model.get_input_embeddings(), model.get_output_embeddings(), whole.dtype, device)
        return Target(parts.to(device), whole.tokenizer, config.name)
    wanted = torch_dtype(dtype or config.dtype)
    source, tied, files = _embedding_files(config.name)
    mapped = device.type == "cpu"
    parts = mapped_parts(files, tied, wanted) if mapped else read_parts(files, tied, wanted, device)
    return Target(parts, with_pad_token(load_tokenizer(config.name)), config.name)


def _embedding_files(name: str) -> tuple[str | Path, bool, dict[str, Path]]:
    """The target's folder, whether its LM head is tied to the embeddings, and the safetensors files holding them."""
    source = model_source(name)
    tied = tied_embeddings(source)
    names = {EMBED} if tied else {EMBED, LM_HEAD}
    files = tensor_files(source, names)
    if names - files.keys():
        raise KeyError(f"target {name!r} has no tensors {sorted(names - files.keys())} in its safetensors")
    return source, tied, files


def load_training_target(config: TargetConfig, dtype: torch.dtype = torch.float32) -> Target:
    """What training on cached features reads from the target: embeddings and LM head read whole in `dtype`
    (training's `FrozenTarget` dtype, so no second copy is made) on the target's device, the tokenizer and the
    model config (head shapes); no decoder layer, no final norm (the stored features are post-norm)."""
    device = resolve_device(config)
    if config.name in TINY_TARGETS:
        whole = load_target(config)
        model = whole.model
        embed = torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().to(dtype), freeze=True)
        lm_head = torch.nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
        lm_head.weight = torch.nn.Parameter(model.get_output_embeddings().weight.detach().to(dtype), requires_grad=False)
        return Target(parts_of(embed, lm_head, dtype, device, model.config).to(device), whole.tokenizer, config.name)
    source, tied, files = _embedding_files(config.name)
    model_config = transformers.AutoConfig.from_pretrained(source)
    parts = read_parts(files, tied, dtype, device, model_config)
    return Target(parts, with_pad_token(load_tokenizer(config.name)), config.name)
