"""Proposers by name: what configs, the CLI, Ray actors and the Serve app all use to get a drafter.

Names: `plain` (no drafting), any trained head by its mixture name (`math`, `chat`, `mixed`, ...), and the
combinations of the first two specialised heads (`averaged`, `confidence-routed`, `entropy-routed`,
`merged`, ... registered in `COMBINATIONS`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from taps_ray.config import StudyConfig, TreeConfig
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.target import Target
from taps_ray.spec.proposers import PlainDecoding, Proposer, SingleHead
from taps_ray.spec.tree import DraftContext

# name -> builder(heads in config order, context, tree) ; filled by taps_ray.spec.combine
COMBINATIONS: dict[str, Callable[[dict[str, DraftHead], DraftContext, TreeConfig], Proposer]] = {}


class UnknownProposer(ValueError):
    pass


def head_dir(config: StudyConfig, kind: str, mixture: str) -> Path:
    """Where the trainer leaves the final checkpoint of one head."""
    return config.work_path("heads", f"{kind}-{mixture}", "final")


def load_heads(config: StudyConfig, kind: str, dtype: torch.dtype, mixtures: list[str] | None = None) -> dict[str, DraftHead]:
    """The trained heads of one kind, keyed by mixture name, in the order of `train.mixtures`."""
    heads = {}
    for mixture in mixtures or config.train.mixtures:
        folder = head_dir(config, kind, mixture)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"no trained {kind} head for mixture {mixture!r} at {folder}; "
                f"run `taps train --config <cfg> --kind {kind} --mixture {mixture}` (or the sweep) first"
            )
        heads[mixture] = DraftHead.load(folder, dtype=dtype).eval()
    return heads


def proposer_names(config: StudyConfig) -> list[str]:
    _load_combinations()
    return ["plain", *config.train.mixtures, *COMBINATIONS]


def build_proposer(
    name: str, target: Target, heads: dict[str, DraftHead], tree: TreeConfig, vocab: torch.Tensor | None = None
) -> Proposer:
    """`vocab`: the reduced draft vocabulary (see draft_vocab.py), or None to draft over the full vocabulary."""
    _load_combinations()
    context = DraftContext(target.model.get_input_embeddings(), target.model.lm_head, vocab)
    if name == "plain":
        return PlainDecoding()
    if name in heads:
        return SingleHead(name, heads[name], context, tree)
    if name in COMBINATIONS:
        return COMBINATIONS[name](heads, context, tree)
    known = ", ".join(["plain", *heads, *COMBINATIONS])
    raise UnknownProposer(f"unknown proposer {name!r}; choose one of: {known}")


def _load_combinations() -> None:
    import taps_ray.spec.combine  # noqa: F401  (registers the combination proposers; imported late, it imports us)
