"""The spawn rule: when a routed model's recent traffic decodes badly on every head, ask for a new head.

Per finished request the replica knows its tau and, from its step records, how each head did on the steps it
drafted alone (`head_stats`; a merged step's tree mixes heads and a paused step drafted nothing, so neither
counts). `SpawnRule` keeps the last `window` requests; once `after` of them are low (tau below `below_tau`) and no
head's pooled tau over those low requests reaches `below_tau`, it names the closest head (the best pooled tau over
them; ties to the earlier head) to fork from. It then starts a fresh window, so one spell of low traffic asks once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from taps_ray.adapt.swap import LiveStats
from taps_ray.decoding.continuous import Result


def head_stats(result: Result, names: list[str]) -> dict[str, LiveStats]:
    """Each head's counts over the steps whose tree it drafted alone (`StepRecord.head` indexes `names`)."""
    out: dict[str, LiveStats] = {}
    for step in result.generation.steps:
        if 0 <= step.head < len(names):
            stats = out.setdefault(names[step.head], LiveStats(requests=1))
            stats.add(LiveStats(0, 1, step.new_tokens, step.accepted, step.tree_size - 1))
    return out


def router_head(stats: dict[str, LiveStats]) -> str | None:
    """The head that drafted most of a request's steps (the router's choice for it), None if none drafted."""
    return max(stats, key=lambda h: stats[h].steps) if stats else None


@dataclass(frozen=True)
class Finished:
    tau: float
    heads: dict[str, LiveStats]


class SpawnRule:
    def __init__(self, below_tau: float, window: int, after: int) -> None:
        self.below_tau, self.after = below_tau, after
        self.recent: deque[Finished] = deque(maxlen=window)

    def is_low(self, tau: float) -> bool:
        return tau < self.below_tau

    def add(self, tau: float, heads: dict[str, LiveStats], names: list[str]) -> str | None:
        """Count a finished request (its tau, `head_stats`); the head to fork from when the rule fires, else None.
        `names`: the routed model's heads in order (the closest of equals is the earlier)."""
        self.recent.append(Finished(tau, heads))
        low = [r for r in self.recent if self.is_low(r.tau)]
        if len(low) < self.after:
            return None
        pooled = {name: LiveStats() for name in names}
        for request in low:
            for name, stats in request.heads.items():
                if name in pooled:
                    pooled[name].add(stats)
        if any(not self.is_low(s.tau) for s in pooled.values() if s.steps):
            return None  # some head does well on this traffic: the router has somewhere to send it
        self.recent.clear()
        return max(names, key=lambda n: (pooled[n].tau, -names.index(n)))
