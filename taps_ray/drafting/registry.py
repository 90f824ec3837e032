"""Proposers by name: what configs, the CLI, Ray actors and the Serve app all use to get a drafter.

Names: `plain` (no drafting), `ngram` (prompt lookup, no head), any trained head by its mixture name (`math`,
`chat`, `mixed`, ...), `searched` (the best head of the mixture search, `taps search`; it drafts alone), the
combinations of the first two specialised heads in `COMBINATIONS`, `averaged-w{w}` for any weight w of head A in
[0, 1] (`averaged` is w = 0.5), and `<name>+ngram` for any of those that drafts (`math+ngram`, `merged+ngram`): its
tree merged with prompt-lookup drafts, and `auto-<name>` for any of them (`auto-math+ngram`): <name> under the
per-sequence cost model, which drafts only while it pays. The table is plain data: importing it registers nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from taps_ray.config import StudyConfig, TreeConfig
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.target import Target
from taps_ray.drafting.combine import (
    build_averaged,
    build_confidence_routed,
    build_entropy_routed,
    build_merged,
    build_merged_budget,
    build_merged_dedup,
    with_ngram,
)
from taps_ray.drafting.cost import CostAware
from taps_ray.drafting.names import (
    ALIASES,
    AVERAGED_SWEEP,
    NGRAM,
    NGRAM_SUFFIX,
    PLAIN,
    ProposerSpec,
    UnknownProposer,
    averaged_name,
    parse_proposer,
)
from taps_ray.drafting.ngram import NUM_TOKENS, NgramProposer
from taps_ray.drafting.proposers import PlainDecoding, Proposer, SingleHead
from taps_ray.drafting.tree import DraftContext
from taps_ray.spelling import did_you_mean

Builder = Callable[[dict[str, DraftHead], DraftContext, TreeConfig], Proposer]

# name -> builder(heads in config order, context, tree); the averaged family is parsed, see `names.parse_proposer`
COMBINATIONS: dict[str, Builder] = {
    "confidence-routed": build_confidence_routed,
    "entropy-routed": build_entropy_routed,
    "merged": build_merged,
    "merged-dedup": build_merged_dedup,
    "merged-budget": build_merged_budget,
}


def combination(name: str) -> Builder | None:
    """The builder of a combination name, or None when `name` is not one."""
    w = parse_proposer(name).weight
    if w is not None:
        return functools.partial(build_averaged, w=w, name=name)
    return COMBINATIONS.get(name)


def combination_names() -> list[str]:
    return [*map(averaged_name, AVERAGED_SWEEP), *COMBINATIONS]


def single_names(heads: Sequence[str]) -> list[str]:
    """The proposers that need at most one of `heads`: plain, each head, n-gram lookup, each head + n-gram."""
    return [PLAIN, *heads, NGRAM, *(f"{h}{NGRAM_SUFFIX}" for h in heads)]


def draft_reach(tree: TreeConfig) -> int:
    """How many tokens past a committed root the deepest draft of any proposer named here reads: its deepest node
    (an EAGLE tree's `tree.depth`, a prompt-lookup chain's `NUM_TOKENS`, alone, merged or cost-aware) plus the
    bonus token after it. Replay records this far past an answer's end, so a fully accepted draft is always
    checked against recorded tokens."""
    return max(tree.depth, NUM_TOKENS) + 1


def proposer_names(config: StudyConfig) -> list[str]:
    return [*single_names(config.head_mixtures()), *combination_names()]


def heads_used(name: str, mixtures: Sequence[str], alone: Sequence[str] = ()) -> list[str]:
    """The mixtures whose heads proposer `name` drafts with (in `mixtures` order; a combination uses all of
    `mixtures`). `alone`: heads that draft only by themselves (`train.compare`), never in a combination."""
    spec = parse_proposer(name)
    if not spec.drafts_with_heads:
        return []
    return [spec.base] if spec.base in mixtures or spec.base in alone else list(mixtures)


def build_proposer(
    name: str, target: Target, heads: dict[str, DraftHead], tree: TreeConfig, vocab: torch.Tensor | None = None
) -> Proposer:
    """`heads`: by mixture, in order; a combination drafts with all of them (the first two where it takes two), so
    stand-alone heads (compare twins, `searched`) are left out by the caller (`drafting.setup.load_proposers`).
    `vocab`: the reduced draft vocabulary (taps_ray/data/draft_vocab.py), or None for the full vocabulary.
    Only a proposer that drafts with a head makes a `DraftContext`: a CPU drafter reads its LM head then."""
    return _build(parse_proposer(name), target, heads, tree, vocab)


def _build(spec: ProposerSpec, target: Target, heads: dict[str, DraftHead], tree: TreeConfig,
           vocab: torch.Tensor | None) -> Proposer:
    name = spec.name
    if spec.auto:
        return CostAware(_build(spec.without_auto(), target, heads, tree, vocab), name=name)
    if spec.ngram:
        return with_ngram(_build(spec.without_ngram(), target, heads, tree, vocab), tree, name)
    if name == PLAIN:
        return PlainDecoding()
    if name == NGRAM:
        return NgramProposer()
    context = DraftContext(target.model.get_input_embeddings(), target.model.lm_head, vocab)
    if name in heads:
        return SingleHead(name, heads[name], context, tree)
    builder = combination(name)
    if builder is None:
        raise _unknown(name, list(heads))
    return builder(heads, context, tree)


def check_name(name: str, heads: Sequence[str]) -> ProposerSpec:
    """The spec of `name` when a study with `heads` can build it; else an `UnknownProposer` with the near miss.
    Needs no model, so a command checks its names before it loads one."""
    spec = parse_proposer(name)
    if spec.base not in (PLAIN, NGRAM) and spec.base not in heads and combination(spec.base) is None:
        raise _unknown(name, heads)
    return spec


def _unknown(name: str, heads: Sequence[str]) -> UnknownProposer:
    known = [*single_names(heads), *combination_names()]
    return UnknownProposer(
        f"unknown proposer {name!r}{did_you_mean(name, [*known, *ALIASES])}; choose one of: {', '.join(known)}, "
        f"{', '.join(ALIASES)} (or averaged-w{{w}}, w in [0, 1]; any drafting proposer followed by +ngram; any "
        "proposer after auto- for the cost model)"
    )
