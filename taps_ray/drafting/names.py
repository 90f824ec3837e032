"""Proposer names that need no model: the spec a name parses into, the `averaged-w{w}` family and the study's
sweep of weights.

A name is `[auto-]<base>[+ngram]`: `<base>` is `plain`, `ngram`, a head (its mixture name, `searched`) or a
combination (`merged`, `averaged-w{w}`, ...); `+ngram` merges a drafting base with prompt-lookup drafts and `auto-`
puts the whole under the per-sequence cost model. `parse_proposer` is the one parser: the registry builds from
its spec, the set-up and Serve ask it which heads a name drafts with, the report reads the averaged weight.
Kept apart from the registry (which builds proposers, and so imports torch and the heads) so that the report,
which only reads results, parses names the same way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PLAIN = "plain"
NGRAM = "ngram"
NGRAM_SUFFIX = "+ngram"
AUTO_PREFIX = "auto-"  # `auto-<name>`: <name> under the per-sequence cost model (drafting/cost.py)
AVERAGED_SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)  # the averaged weights the study lists (`registry.proposer_names`)
_AVERAGED = re.compile(r"^averaged-w(.*)$")
ALIASES = {"routed": "confidence-routed"}  # short names README, Serve and `taps generate` accept


class UnknownProposer(ValueError):
    pass


def averaged_name(w: float) -> str:
    return "averaged" if w == 0.5 else f"averaged-w{w:g}"


def entropy_candidates(heads: list[str]) -> list[str]:
    """The parts `entropy-routed` chooses among, in index order (`StepRecord.head`): as TAPS's entropy router, every
    trained head and then the averaged head (w = 0.5 of the first two) when there are two
    (docs/algorithms.md#entropy-routing)."""
    return [*heads, averaged_name(0.5)] if len(heads) >= 2 else list(heads)


def averaged_weight(name: str) -> float | None:
    """The weight of head A in an `averaged-w{w}` name (`averaged` is 0.5), None for other names."""
    if name == "averaged":
        return 0.5
    match = _AVERAGED.match(name)
    if match is None:
        return None
    try:
        w = float(match.group(1))
    except ValueError:
        w = math.nan
    if not 0.0 <= w <= 1.0:  # also false for nan
        raise UnknownProposer(
            f"proposer {name!r}: the averaging weight after 'averaged-w' must be a number in [0, 1] "
            "(the weight of head A), e.g. averaged-w0.3"
        )
    return w


@dataclass(frozen=True)
class ProposerSpec:
    """A parsed proposer name (`parse_proposer`)."""

    base: str  # plain, ngram, a head's mixture name, or a combination's name
    weight: float | None = None  # `averaged-w{w}`: the weight of head A (`averaged`: 0.5); None for other bases
    ngram: bool = False  # `+ngram`: the base's tree merged with prompt-lookup drafts
    auto: bool = False  # `auto-`: under the per-sequence cost model

    @property
    def name(self) -> str:
        return f"{AUTO_PREFIX if self.auto else ''}{self.base}{NGRAM_SUFFIX if self.ngram else ''}"

    @property
    def drafts_with_heads(self) -> bool:
        """Whether the base drafts with trained heads (plain and n-gram lookup use none)."""
        return self.base not in (PLAIN, NGRAM)

    def without_auto(self) -> ProposerSpec:
        return ProposerSpec(self.base, self.weight, self.ngram)

    def without_ngram(self) -> ProposerSpec:
        return ProposerSpec(self.base, self.weight, auto=self.auto)


def parse_proposer(name: str) -> ProposerSpec:
    """The spec of `name`: an `auto-` prefix, then a `+ngram` suffix on a base that drafts with heads
    (`plain+ngram` and `ngram+ngram` are bases no head or combination has: the registry rejects them); an alias
    base (`ALIASES`) is read as the name it stands for."""
    auto = name.startswith(AUTO_PREFIX)
    rest = name.removeprefix(AUTO_PREFIX)
    base = rest.removesuffix(NGRAM_SUFFIX)
    ngram = base != rest and base not in (PLAIN, NGRAM)
    base = ALIASES.get(base if ngram else rest, base if ngram else rest)  # `routed` is `confidence-routed`
    return ProposerSpec(base, averaged_weight(base), ngram, auto)
