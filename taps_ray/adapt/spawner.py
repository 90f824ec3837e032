"""The trainer's side of spawning: a head forked from the closest one, trained on the traffic no head does well on.

While a replica's spawn ask is pending (`HeadSet.asked`: the head to fork from, the closest on that traffic), each
round trains the fork on the buffer's low sequences only (tagged `low` by the replica) recorded since the last
spawn, so a second spawn does not learn the first one's traffic again. The newest `heldout_fraction` of them is
held out; the fork is added to the routed model (`HeadSet.add`, under `max_heads`) once it agrees with the target
on them better than its parent by more than `min_gain`; until then it keeps training, round after round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from taps_ray.adapt.buffer import TrafficBuffer
from taps_ray.adapt.candidate import Candidate, TargetSide
from taps_ray.adapt.heads import HeadSet
from taps_ray.models.draft_head import DraftHead


@dataclass
class SpawnRound:
    parent: str
    fork_acc: float
    parent_acc: float
    spawned: str | None  # the new head's name, or None: the fork is not better yet
    train_sequences: int
    heldout_sequences: int
    seconds: float


class Spawner:
    def __init__(self, heads: HeadSet, buffer: TrafficBuffer, side: TargetSide) -> None:
        self.heads, self.buffer, self.side = heads, buffer, side
        self.parent: str | None = None
        self.fork: Candidate | None = None

    def round(self) -> SpawnRound | None:
        """One round of the pending spawn; None when none is asked or fewer than two low sequences are buffered."""
        parent = self.heads.asked()
        if parent is None:
            self.parent = self.fork = None
            return None
        start = time.perf_counter()
        heads = {h.name: h for h in self.heads.heads()}
        since = max(h.created for h in heads.values())
        shards = [s for s in self.buffer.shards() if s.created > since]
        low = [self.side.with_topk(e) for e in self.buffer.read(shards, where=lambda tag: bool(tag.get("low")))
               if int(e.loss_mask.sum()) > 0]
        if len(low) < 2:
            return None
        served = self.heads.store(heads[parent]).current().path
        if self.fork is None or self.parent != parent:
            self.parent, self.fork = parent, Candidate(self.side.cfg, served)
        train, held = self.side.split(low)
        self.side.train(self.fork, train)
        fork_acc = self.side.agreement(self.fork.head, held)
        parent_acc = self.side.agreement(DraftHead.load(served), held)
        spawned = None
        if fork_acc > parent_acc + self.side.adapt.min_gain:
            metrics = {"heldout_acc": fork_acc, "parent_acc": parent_acc, "heldout_sequences": len(held)}
            entry = self.heads.add(parent, self.fork.head, metrics)
            spawned = entry.name if entry is not None else None
            self.parent = self.fork = None
        return SpawnRound(parent, fork_acc, parent_acc, spawned, len(train), len(held), time.perf_counter() - start)
