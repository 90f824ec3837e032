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
from taps_ray.machine import native_bf16
from taps_ray.models.target import Target, torch_dtype
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.registry import build_proposer, check_name, heads_used
from taps_ray.workdir import SEARCHED, head_checkpoint, searched_head


def head_names(cfg: StudyConfig, kind: str) -> list[str]:
    """The heads of a `kind` study: train.mixtures in order, the `train.compare` heads of this kind, then
    `searched` once `taps search` has saved one."""
    searched = (searched_head(cfg, kind) / "model.safetensors").is_file()
    return [*cfg.head_mixtures(kind), *([SEARCHED] if searched else [])]


def with_searched(cfg: StudyConfig, kind: str, names: Sequence[str]) -> list[str]:
    """`names`, then `searched` when `taps search` saved a `kind` head that `names` does not list: the searched
    head joins the study's evaluation once it exists."""
    if SEARCHED in names or SEARCHED not in head_names(cfg, kind):
        return list(names)
    return [*names, SEARCHED]


def load_heads(cfg: StudyConfig, kind: str, dtype: torch.dtype, mixtures: Sequence[str] | None = None,
               device: torch.device | str = "cpu") -> dict[str, DraftHead]:
    """The trained heads of one kind, keyed by mixture name, in the order of `head_names` (default: all of them),
    on `device` (the target's)."""
    mixtures = head_names(cfg, kind) if mixtures is None else mixtures
    check_heads(cfg, kind, mixtures)
    return {mixture: DraftHead.load(head_checkpoint(cfg, kind, mixture), dtype=dtype, device=device).eval()
            for mixture in mixtures}


def draft_dtype(choice: str | None, target: Target) -> torch.dtype:
    """The dtype heads draft in for `serve.draft_dtype`: None is the target's; `auto` is bfloat16 under a float32
    target on a CPU that multiplies bf16 natively (a draft pass reads half the bytes), else the target's."""
    if choice == "auto":
        halved = target.dtype == torch.float32 and target.device.type == "cpu" and native_bf16()
        return torch.bfloat16 if halved else target.dtype
    return torch_dtype(choice) if choice else target.dtype


def check_heads(cfg: StudyConfig, kind: str, mixtures: Sequence[str]) -> None:
    """A FileNotFoundError naming the first of the `kind` heads `mixtures` that is not trained, and how to train
    it; checked before anything loads."""
    for mixture in mixtures:
        folder = head_checkpoint(cfg, kind, mixture)
        if not folder.is_dir():
            how = (f"run `taps search --config <cfg>` with search.kind {kind}" if mixture == SEARCHED else
                   f"run `taps train --config <cfg> --kind {kind} --mixture {mixture}` (or the sweep)")
            raise FileNotFoundError(f"no trained {kind} head for mixture {mixture!r} at {folder}; {how} first")


def check_proposers(cfg: StudyConfig, names: Sequence[str], kind: str) -> list[str]:
    """`names` with their aliases resolved (`routed`), once each is a proposer this study builds and its `kind`
    heads are trained: a misspelt name or a missing head fails in one line before the target loads."""
    canonical = [check_name(name, [*cfg.head_mixtures(kind), SEARCHED]).name for name in names]
    check_heads(cfg, kind, heads_needed(cfg, canonical))
    return canonical


def heads_needed(cfg: StudyConfig, names: Sequence[str]) -> list[str]:
    """The mixtures whose heads `names` draft with: a single head (a compare twin, `searched`) needs itself, a
    combination every head of train.mixtures."""
    used = {mixture for name in names for mixture in _used(cfg, name)}
    return [mixture for mixture in [*cfg.head_mixtures(), SEARCHED] if mixture in used]


def _alone(cfg: StudyConfig) -> list[str]:
    """Heads that draft only by themselves, never inside a combination: compare twins and the searched head."""
    return [*cfg.train.compare, SEARCHED]


def _used(cfg: StudyConfig, name: str) -> list[str]:
    return heads_used(name, cfg.train.mixtures, _alone(cfg))


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
    """`heads` less the stand-alone heads (`_alone`) `name` does not draft with, so combinations see the study's
    heads only."""
    used, alone = _used(cfg, name), _alone(cfg)
    return {m: head for m, head in heads.items() if m not in alone or m in used}
