"""Proposers from a study's work dir: target -> heads -> draft vocabulary -> proposers.

Evaluation, `taps generate`, the Ray drafters, Serve, bench and the benchmarks all set their proposers up
here, so a proposer name travels one path from the CLI to the engine's registry and its verify step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from taps_ray.config import StudyConfig
from taps_ray.data.draft_vocab import draft_vocabulary
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.target import Target
from taps_ray.engine.proposers import Proposer
from taps_ray.engine.registry import build_proposer, heads_used
from taps_ray.workdir import head_checkpoint


def load_heads(cfg: StudyConfig, kind: str, dtype: torch.dtype, mixtures: Sequence[str] | None = None,
               device: torch.device | str = "cpu") -> dict[str, DraftHead]:
    """The trained heads of one kind, keyed by mixture name, in the order of `train.mixtures` (then those of
    `train.compare` that have this kind), on `device` (the target's)."""
    heads = {}
    for mixture in cfg.head_mixtures(kind) if mixtures is None else mixtures:
        folder = head_checkpoint(cfg, kind, mixture)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"no trained {kind} head for mixture {mixture!r} at {folder}; "
                f"run `taps train --config <cfg> --kind {kind} --mixture {mixture}` (or the sweep) first"
            )
        heads[mixture] = DraftHead.load(folder, dtype=dtype, device=device).eval()
    return heads


def heads_needed(cfg: StudyConfig, names: Sequence[str]) -> list[str]:
    """The mixtures whose heads `names` draft with: a single head needs itself, a combination every head of
    train.mixtures."""
    used = {mixture for name in names for mixture in _used(cfg, name)}
    return [mixture for mixture in cfg.head_mixtures() if mixture in used]


def _used(cfg: StudyConfig, name: str) -> list[str]:
    return heads_used(name, cfg.train.mixtures, list(cfg.train.compare))


def load_proposers(
    cfg: StudyConfig,
    names: Sequence[str],
    *,
    target: Target,
    kind: str | None = None,
    heads: dict[str, DraftHead] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Proposer]:
    """The proposers `names`, keyed by name, drafting over the study's draft vocabulary.

    `heads`: the heads to draft with when the caller holds them already (shipped to a Ray drafter, or shared
    by every cell of a kind); otherwise the `kind` heads the names need are loaded in `dtype` (the target's
    by default).
    """
    if heads is None:
        needed = heads_needed(cfg, names)
        if needed and kind is None:
            raise ValueError(f"proposers {list(names)} draft with trained heads: say which kind to load")
        heads = load_heads(cfg, kind, dtype or target.dtype, needed, target.device) if needed else {}
    drafts = any(_used(cfg, name) for name in names)  # plain and n-gram draft with no head
    vocab = draft_vocabulary(cfg, target.tokenizer, target.stop_token_ids) if drafts else None
    return {name: build_proposer(name, target, _drafting(cfg, name, heads), cfg.tree, vocab) for name in names}


def _drafting(cfg: StudyConfig, name: str, heads: dict[str, DraftHead]) -> dict[str, DraftHead]:
    """`heads` less the compare heads `name` does not draft with, so combinations see the study's heads only."""
    used = _used(cfg, name)
    return {m: head for m, head in heads.items() if m not in cfg.train.compare or m in used}
