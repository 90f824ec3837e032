"""The replica's side of versioning: load a published head between decode steps, roll back on live acceptance.

A swap replaces the model's proposer in the replica's table; requests admitted from then on draft with the new
version, requests already decoding keep the version they started with (a head's draft cache is built by its own
weights, so a sequence never mixes two). Nothing is dropped or restarted, and verification is untouched, so the
output stays the target's whatever version drafts.

Rollback: every finished request counts into its version's live τ (tokens per verification step). Once the
served version and the one before it both have `min_requests` finished requests, the served one is rolled back
when its τ is below the previous one's by more than `margin` (`should_roll_back`); the store then never serves
it again, and the trainer restarts from the version it falls back to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from taps_ray.adapt.versions import VersionStore
from taps_ray.decoding.continuous import Result
from taps_ray.drafting.proposer import Proposer
from taps_ray.models.draft_head import DraftHead

logger = logging.getLogger("ray.serve")


@dataclass
class LiveStats:
    """One version's finished requests on this replica."""

    requests: int = 0
    steps: int = 0
    tokens: int = 0  # tokens per step as every report counts them (`StepRecord.new_tokens`)
    accepted: int = 0
    drafted: int = 0  # drafted nodes verified (the root is not a draft; a step that did not draft verified none)

    @classmethod
    def of(cls, result: Result) -> LiveStats:
        """One finished request's counts."""
        steps = result.generation.steps
        return cls(1, len(steps), sum(s.new_tokens for s in steps), sum(s.accepted for s in steps),
                   sum(s.tree_size - 1 for s in steps))

    def add(self, other: LiveStats) -> None:
        for name in ("requests", "steps", "tokens", "accepted", "drafted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def should_roll_back(served: LiveStats, previous: LiveStats | None, min_requests: int, margin: float) -> bool:
    """The served version's live τ fell below its predecessor's (both measured on enough requests)."""
    if previous is None or served.requests < min_requests or previous.requests < min_requests:
        return False
    return served.tau < previous.tau - margin


class ServedModel:
    """One adapted model on one replica: its served version, the proposers of the versions it has served, and
    their live acceptance."""

    def __init__(self, name: str, store: VersionStore, build: Callable[[DraftHead], Proposer],
                 install: Callable[[Proposer], None], min_requests: int, margin: float,
                 loaded: Proposer | None = None) -> None:
        """`loaded`: version 0's proposer when the replica has it already (a routed model's own head), not rebuilt."""
        self.name, self.store, self.build, self.install = name, store, build, install
        self.min_requests, self.margin = min_requests, margin
        self.proposers: dict[int, Proposer] = {} if loaded is None else {0: loaded}
        self.stats: dict[int, LiveStats] = {}
        self.previous: int | None = None
        self.version = -1
        self.rollback_due: int | None = None
        self.swaps = 0

    def version_of(self, proposer: Proposer) -> int | None:
        return next((v for v, p in self.proposers.items() if p is proposer), None)

    def poll(self) -> bool:
        """Serve the store's current version (built on first use); returns whether the served version changed.
        Runs between decode steps: a roll back asked for by `finished` is written to the store first."""
        rolled_back = self.rollback_due is not None
        if rolled_back:
            logger.warning("adapt %s: version %d's live tau %.2f is below version %s's %.2f; rolling back",
                           self.name, self.rollback_due, self.stats[self.rollback_due].tau, self.previous,
                           self.stats[self.previous].tau)
            self.store.roll_back(self.rollback_due)
            self.rollback_due = None
        current = self.store.current()
        if current.number == self.version:
            return False
        proposer = self.proposers.get(current.number)
        if proposer is None:
            proposer = self.build(DraftHead.load(current.path))
        if self.version >= 0:  # after a roll back there is nothing to compare with: no previous version
            self.previous = None if rolled_back else self.version
            self.swaps += 1
        # a new table, never an edit: the event loop reads it (`version_of`) while this runs on the decoding thread;
        # older versions' proposers go (their requests still decoding keep their own reference)
        self.proposers = {v: p for v, p in self.proposers.items() if v == self.previous} | {current.number: proposer}
        self.install(proposer)
        self.version = current.number
        self.stats.setdefault(self.version, LiveStats())
        logger.info("adapt %s: serving version %d", self.name, self.version)
        return True

    def finished(self, version: int, request: LiveStats) -> LiveStats:
        """Count a finished request of `version` (`LiveStats.of`); flags a roll back (done at the next `poll`) when
        the rule says so. Returns the version's totals."""
        stats = self.stats.setdefault(version, LiveStats())
        stats.add(request)
        if version == self.version and self.previous is not None and self.rollback_due is None:
            if should_roll_back(stats, self.stats.get(self.previous), self.min_requests, self.margin):
                self.rollback_due = version
        return stats
