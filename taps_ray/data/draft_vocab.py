"""The reduced draft vocabulary: the most frequent assistant tokens of the training corpora (EAGLE-3 style).

Built once per (work dir, size) from the study's training mixtures, cached as safetensors, and shared by all
heads of a study so routers and merged trees draft over the same ids. Stop tokens are always included.
"""

from __future__ import annotations

from collections import Counter

import torch
from safetensors.torch import load_file, save_file

from taps_ray.config import StudyConfig
from taps_ray.data.sources import load_conversations
from taps_ray.fsio import atomic_path
from taps_ray.workdir import draft_vocab_file

SAMPLE_PER_CORPUS = 4000


def frequent_tokens(tokenizer, texts: list[str], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent token ids in `texts` (plus `always`), sorted ascending."""
    counts: Counter[int] = Counter()
    for start in range(0, len(texts), 256):
        for ids in tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]:
            counts.update(ids)
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def _assistant_texts(config: StudyConfig) -> list[str]:
    """Assistant turns of the first SAMPLE_PER_CORPUS conversations of every corpus the study trains on."""
    corpora = sorted({c for name in config.train.mixtures for c in config.mixtures[name].mixture})
    texts = []
    for corpus in corpora:
        for conversation in load_conversations(corpus, config.resolved_data_dir(), limit=SAMPLE_PER_CORPUS):
            texts += [m["content"] for m in conversation.messages if m["role"] == "assistant"]
    return texts


_LOADED: dict[str, torch.Tensor] = {}


def draft_vocabulary(config: StudyConfig, tokenizer, stop_ids: list[int]) -> torch.Tensor | None:
    """The study's draft vocabulary, or None when `tree.draft_vocab_size` is unset (full vocabulary)."""
    size = config.tree.draft_vocab_size
    if size is None or size >= len(tokenizer):
        return None
    file = draft_vocab_file(config, size)
    key = str(file.resolve())
    if key not in _LOADED:
        if not file.is_file():
            vocab = frequent_tokens(tokenizer, _assistant_texts(config), size, stop_ids)
            with atomic_path(file) as tmp:  # a reader never sees half a file
                save_file({"vocab": vocab}, str(tmp))
        _LOADED[key] = load_file(str(file))["vocab"]
    return _LOADED[key]
