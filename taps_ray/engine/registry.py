"""Proposers by name: what configs, the CLI, Ray actors and the Serve app all use to get a drafter.

Names: `plain` (no drafting), any trained head by its mixture name (`math`, `chat`, `mixed`, ...), the
combinations of the first two specialised heads in `COMBINATIONS`, and `averaged-w{w}` for any weight w of
head A in [0, 1] (`averaged` is w = 0.5). The table is plain data: importing it registers nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from taps_ray.config import StudyConfig, TreeConfig
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.target import Target
from taps_ray.engine.combine import (
    build_averaged,
    build_confidence_routed,
    build_entropy_routed,
    build_merged,
    build_merged_budget,
    build_merged_dedup,
)
from taps_ray.engine.names import AVERAGED_SWEEP, UnknownProposer, averaged_name, averaged_weight
from taps_ray.engine.proposers import PlainDecoding, Proposer, SingleHead
from taps_ray.engine.tree import DraftContext

Builder = Callable[[dict[str, DraftHead], DraftContext, TreeConfig], Proposer]

# name -> builder(heads in config order, context, tree); the averaged family is parsed, see `averaged_weight`
COMBINATIONS: dict[str, Builder] = {
    "confidence-routed": build_confidence_routed,
    "entropy-routed": build_entropy_routed,
    "merged": build_merged,
    "merged-dedup": build_merged_dedup,
    "merged-budget": build_merged_budget,
}


def combination(name: str) -> Builder | None:
    """The builder of a combination name, or None when `name` is not one."""
    w = averaged_weight(name)
    if w is not None:
        return functools.partial(build_averaged, w=w, name=name)
    return COMBINATIONS.get(name)


def combination_names() -> list[str]:
    return [*map(averaged_name, AVERAGED_SWEEP), *COMBINATIONS]


def proposer_names(config: StudyConfig) -> list[str]:
    return ["plain", *config.train.mixtures, *combination_names()]


def build_proposer(
    name: str, target: Target, heads: dict[str, DraftHead], tree: TreeConfig, vocab: torch.Tensor | None = None
) -> Proposer:
    """`vocab`: the reduced draft vocabulary (taps_ray/data/draft_vocab.py), or None for the full vocabulary."""
    context = DraftContext(target.model.get_input_embeddings(), target.model.lm_head, vocab)
    if name == "plain":
        return PlainDecoding()
    if name in heads:
        return SingleHead(name, heads[name], context, tree)
    builder = combination(name)
    if builder is None:
        known = ", ".join(["plain", *heads, *combination_names()])
        raise UnknownProposer(f"unknown proposer {name!r}; choose one of: {known} (or averaged-w{{w}}, w in [0, 1])")
    return builder(heads, context, tree)
