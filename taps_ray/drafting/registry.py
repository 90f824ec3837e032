"""Proposers by name: what configs, the CLI, Ray actors and the Serve app all use to get a drafter.

Names: `plain` (no drafting), `ngram` (prompt lookup, no head), any trained head by its mixture name (`math`,
`chat`, `mixed`, ...), `searched` (the best head of the mixture search, `taps search`; it drafts alone), the
combinations of the first two specialised heads registered in `PROPOSERS`, `averaged-w{w}` for any weight w of head A in
[0, 1] (`averaged` is w = 0.5), and `<name>+ngram` for any of those that drafts (`math+ngram`, `merged+ngram`): its
tree merged with prompt-lookup drafts, and `auto-<name>` for any of them (`auto-math+ngram`): <name> under the
per-sequence cost model, which drafts only while it pays. The table is plain data: importing it registers nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
from taps_ray.drafting.learned import build_learned_routed
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
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.proposers import PlainDecoding, SingleHead
from taps_ray.drafting.eagle2 import DraftContext
from taps_ray.spelling import did_you_mean


@dataclass
class Ingredients:
    """What a builder may draft with: the target, the trained heads by mixture (in config order), the tree
    settings and the reduced draft vocabulary (None: the full one)."""

    target: Target
    heads: dict[str, DraftHead]
    tree: TreeConfig
    vocab: torch.Tensor | None

    @functools.cached_property
    def context(self) -> DraftContext:
        """Made on first use: only a proposer that drafts with a head reads the LM head (a CPU drafter copies it).
        Heads loaded in another dtype than the target's (`serve.draft_dtype`) draft through the LM head in theirs."""
        dtypes = {next(head.parameters()).dtype for head in self.heads.values()}
        if len(dtypes) > 1:
            raise ValueError(f"the heads draft in one dtype, not {sorted(map(str, dtypes))}: load them alike")
        dtype = next(iter(dtypes), self.target.dtype)
        return DraftContext(self.target.model.get_input_embeddings(), self.target.model.lm_head, self.vocab,
                            dtype=None if dtype == self.target.dtype else dtype)


Builder = Callable[[Ingredients], Proposer]
HeadsBuilder = Callable[[dict[str, DraftHead], DraftContext, TreeConfig], Proposer]


def _over_heads(build: HeadsBuilder) -> Builder:
    """A combination's builder (drafting/combine.py: heads in config order, context, tree) as a registry entry."""
    return lambda parts: build(parts.heads, parts.context, parts.tree)


# The registry: a name -> its builder, for every proposer but a trained head's own name (`SingleHead`) and the
# averaged family (parsed, see `names.parse_proposer`). A new proposer is its class and one entry here.
PROPOSERS: dict[str, Builder] = {
    PLAIN: lambda _: PlainDecoding(),
    NGRAM: lambda _: NgramProposer(),
    "confidence-routed": _over_heads(build_confidence_routed),
    "entropy-routed": _over_heads(build_entropy_routed),
    "merged": _over_heads(build_merged),
    "merged-dedup": _over_heads(build_merged_dedup),
    "merged-budget": _over_heads(build_merged_budget),
    "learned-routed": _over_heads(build_learned_routed),
}


def combination(name: str) -> Builder | None:
    """The builder of a combination name (a registered name that drafts with heads), or None when `name` is not
    one."""
    spec = parse_proposer(name)
    if spec.weight is not None:
        return _over_heads(functools.partial(build_averaged, w=spec.weight, name=name))
    return PROPOSERS.get(name) if spec.drafts_with_heads else None


def combination_names() -> list[str]:
    return [*map(averaged_name, AVERAGED_SWEEP), *(n for n in PROPOSERS if parse_proposer(n).drafts_with_heads)]


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
    return _build(parse_proposer(name), Ingredients(target, heads, tree, vocab))


def _build(spec: ProposerSpec, parts: Ingredients) -> Proposer:
    """The name's wrappers (`auto-`, `+ngram`) around its base: a registered name or a trained head."""
    if spec.auto:
        return CostAware(_build(spec.without_auto(), parts), name=spec.name)
    if spec.ngram:
        return with_ngram(_build(spec.without_ngram(), parts), parts.tree, spec.name)
    if not spec.drafts_with_heads:
        return PROPOSERS[spec.base](parts)
    if spec.base in parts.heads:
        return SingleHead(spec.base, parts.heads[spec.base], parts.context, parts.tree)
    builder = combination(spec.base)
    if builder is None:
        raise _unknown(spec.name, list(parts.heads))
    return builder(parts)


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
