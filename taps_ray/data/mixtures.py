"""Training mixtures (docs/algorithms.md#mixtures): a seeded sample of each corpus, concatenated and shuffled.

Each corpus contributes its share of ``size`` (ratios are normalised; shares are rounded by largest
remainder so they always add up to ``size``). A corpus is shuffled with its own ``random.Random(seed)`` and
its head is taken, so one corpus's selection does not depend on the others in the mixture.
"""

from __future__ import annotations

import math
import os
import random
from typing import Sequence, TypeVar

from taps_ray.config import MixtureConfig
from taps_ray.data.sources import Conversation, load_conversations, resolve

T = TypeVar("T")


class MixtureError(ValueError):
    """A mixture that the available data cannot fill; the message says what to change."""


def mixture_counts(mixture: MixtureConfig) -> dict[str, int]:
    """Conversations per corpus: round(size * ratio / sum of ratios), adjusted to add up to size exactly."""
    total = sum(mixture.mixture.values())
    exact = {name: mixture.size * ratio / total for name, ratio in mixture.mixture.items()}
    counts = {name: math.floor(value) for name, value in exact.items()}
    short = mixture.size - sum(counts.values())
    # hand the remaining units to the largest fractional parts (ties: mixture order)
    order = sorted(exact, key=lambda name: -(exact[name] - counts[name]))
    for name in order[:short]:
        counts[name] += 1
    return counts


def seeded_sample(items: Sequence[T], count: int, seed: int) -> list[T]:
    """The first `count` items of `items` shuffled with random.Random(seed) (the input is not modified)."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[:count]]


def build_mixture(mixture: MixtureConfig, data_dir: str | os.PathLike | None = None) -> list[Conversation]:
    """The mixture's conversations: a seeded sample of each corpus, concatenated and shuffled with the seed."""
    out: list[Conversation] = []
    for name, count in mixture_counts(mixture).items():
        if count == 0:
            continue
        corpus = load_conversations(name, data_dir)
        if len(corpus) < count:
            source = resolve(name, data_dir).source_label
            raise MixtureError(
                f"mixture needs {count} conversations from {name!r} but its source ({source}) has only "
                f"{len(corpus)}; lower the mixture size ({mixture.size}) or the {name} ratio, "
                "or supply a larger copy of the corpus"
            )
        out.extend(seeded_sample(corpus, count, mixture.seed))
    random.Random(mixture.seed).shuffle(out)
    return out
