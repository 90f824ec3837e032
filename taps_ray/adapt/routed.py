"""A routed model under adaptation on one replica: each head's versions swapped inside the router, spawned heads
added to it, and the spawn rule fed (docs/serve.md#spawning-heads).

The served router (confidence-routed, learned-routed, under the cost model or not) is edited, never rebuilt: a new
version of a head replaces that head's drafter inside it (`Proposer.map_heads`), a spawned head drafts beside the
others (`Proposer.with_part`), both built from a part the router already has (the same draft context and tree
settings), between decode steps. Each head is one `ServedModel` (its versions, its live tau over the steps it
drafted alone, its rollback) whose `install` hands the new part here; the router is installed once per poll when
a part changed. Requests already decoding keep the router, and so the heads, they started with; verification is
untouched, so every router is lossless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from taps_ray.adapt.buffer import Tag
from taps_ray.adapt.heads import HeadEntry, HeadSet
from taps_ray.adapt.spawn import SpawnRule, head_stats, router_head
from taps_ray.adapt.swap import ServedModel
from taps_ray.decoding.continuous import Result
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.proposers import SingleHead
from taps_ray.models.draft_head import DraftHead

logger = logging.getLogger("ray.serve")

Event = tuple[str, int, str]  # (head, version, kind: publish, rollback or spawn)
KEEP_ROUTERS = 2  # the served router and the one before it: requests still decoding with it keep counting


class ServedRouted:
    def __init__(self, name: str, heads: HeadSet, router: Proposer, install: Callable[[Proposer], None],
                 min_requests: int, margin: float, rule: SpawnRule | None) -> None:
        """`router`: the routed proposer as the replica built it, over its own heads (listed in `heads`)."""
        self.name, self.heads, self.install, self.rule = name, heads, install, rule
        self.min_requests, self.margin = min_requests, margin
        self.parts: dict[str, SingleHead] = {}
        router.map_heads(lambda part: self.parts.setdefault(part.name, part))
        self.router = router
        self.served: dict[str, ServedModel] = {}
        self.routers: list[tuple[Proposer, dict[str, int]]] = []  # newest last, with each head's version
        self._changed: set[str] = set()
        self.spawned = 0

    def versions_of(self, proposer: Proposer) -> dict[str, int] | None:
        return next((v for p, v in self.routers if p is proposer), None)

    def poll(self) -> list[Event]:
        """Serve every head's current version and every spawned head; installs the router if a part changed."""
        events = []
        for entry in self.heads.heads():
            if entry.name not in self.served:
                self.served[entry.name] = self._serve(entry)
                if entry.parent is not None:
                    events.append((entry.name, 0, "spawn"))
                    self.spawned += 1
            served = self.served[entry.name]
            rolling_back = served.rollback_due is not None
            if served.poll() and served.swaps:
                events.append((entry.name, served.version, "rollback" if rolling_back else "publish"))
        if self._changed or not self.routers:
            self._install()
        return events

    def finished(self, proposer: Proposer, result: Result) -> Tag | None:
        """Count a finished request of this model into its heads' live tau and the spawn rule; its recording's tag
        (the head the router used most, whether it was low), or None when `proposer` is none of this model's."""
        versions = self.versions_of(proposer)
        if versions is None:
            return None
        stats = head_stats(result, proposer.head_names)
        if result.error is None:
            for head, one in stats.items():
                if head in versions:
                    self.served[head].finished(versions[head], one)
            parent = self.rule.add(result.generation.tau, stats, list(self.parts)) if self.rule else None
            if parent is not None and self.heads.ask_spawn(parent):
                logger.warning("adapt %s: recent requests decode below tau %.2f on every head; asked for a head "
                               "forked from %s", self.name, self.rule.below_tau, parent)
        low = self.rule is not None and self.rule.is_low(result.generation.tau)
        return {"head": router_head(stats), "low": low}

    def _serve(self, entry: HeadEntry) -> ServedModel:
        def install(part: SingleHead) -> None:
            self.parts[entry.name] = part
            self._changed.add(entry.name)

        return ServedModel(f"{self.name}/{entry.name}", self.heads.store(entry),
                           lambda head: self._part(entry.name, head), install, self.min_requests, self.margin,
                           loaded=self.parts.get(entry.name))

    def _part(self, name: str, head: DraftHead) -> SingleHead:
        """`head` drafting as the router's parts do (their context and tree settings, device and dtype)."""
        template = next(iter(self.parts.values()))
        weight = next(template.head.parameters())
        return replace(template, name=name, head=head.to(device=weight.device, dtype=weight.dtype).eval())

    def _install(self) -> None:
        router = self.router.map_heads(lambda part: self.parts.get(part.name, part))
        for name in self.parts:
            if name not in router.head_names:
                router = router.with_part(self.parts[name])
        self.router, self._changed = router, set()
        self.routers = [*self.routers, (router, {h: s.version for h, s in self.served.items()})][-KEEP_ROUTERS:]
        self.install(router)
