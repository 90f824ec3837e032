"""Proposer names that need no model: the `averaged-w{w}` family and the study's sweep of weights.

Kept apart from the registry (which builds proposers, and so imports torch and the heads) so that the report,
which only reads results, parses names the same way.
"""

from __future__ import annotations

import math
import re

AVERAGED_SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)  # the averaged weights the study lists (`registry.proposer_names`)
_AVERAGED = re.compile(r"^averaged-w(.*)$")


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
