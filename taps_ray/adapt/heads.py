"""The heads of a routed model under adaptation: which heads it has (the ones it was built with, then the spawned
ones), each head's versions, and the spawn a replica asked for.

    <root>/heads.json                  {"heads": [{"name", "base", "parent", "created"}, ...], "spawn": {...} | null}
    <root>/heads/<head>/versions/      the head's `VersionStore` (versions per model and head)
    <root>/heads/<head>/base/          a spawned head's version 0 (a built-in head's is the work dir's head)

A replica writes the built-in heads when it starts (`ensure`) and asks for a spawn (`ask_spawn`); the trainer adds
the spawned head (`add`: its base folder written with `atomic_dir` before `heads.json` lists it) and that answers
the ask. Every read-modify-write of `heads.json` holds the folder's lock, so the `max_heads` bound holds across
replicas and the trainer.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from taps_ray.adapt.versions import VersionStore
from taps_ray.fsio import atomic_dir, atomic_write_json, folder_lock
from taps_ray.models.draft_head import DraftHead

HEADS = "heads.json"


@dataclass(frozen=True)
class HeadEntry:
    name: str
    base: str  # version 0's folder
    parent: str | None = None  # the head a spawned head was forked from (None: built in)
    created: float = 0.0  # when it was spawned (0: built in)


class HeadSet:
    def __init__(self, root: str | Path, max_heads: int) -> None:
        self.root, self.max_heads = Path(root), max_heads
        self.root.mkdir(parents=True, exist_ok=True)

    def heads(self) -> list[HeadEntry]:
        """Built-in heads first (in the routed model's order), then the spawned ones in the order they came."""
        return [HeadEntry(**h) for h in self._state()["heads"]]

    def store(self, head: HeadEntry) -> VersionStore:
        return VersionStore(self.root / "heads" / head.name / "versions", head.base)

    def ensure(self, built_in: dict[str, Path]) -> None:
        """List the routed model's own heads (name: checkpoint) the first time (a replica starting)."""
        with folder_lock(self.root):
            state = self._state()
            known = {h["name"] for h in state["heads"]}
            fresh = [asdict(HeadEntry(n, str(p))) for n, p in built_in.items() if n not in known]
            if fresh:
                self._write({**state, "heads": fresh + state["heads"]})

    def asked(self) -> str | None:
        """The head a spawn was asked to fork from, while that spawn is pending."""
        spawn = self._state()["spawn"]
        return spawn["parent"] if spawn else None

    def ask_spawn(self, parent: str) -> bool:
        """Ask the trainer for a head forked from `parent`; False when one is pending already or the bound is met."""
        with folder_lock(self.root):
            state = self._state()
            if state["spawn"] is not None or len(state["heads"]) >= self.max_heads:
                return False
            self._write({**state, "spawn": {"parent": parent, "asked": time.time()}})
        return True

    def add(self, parent: str, head: DraftHead, metrics: dict[str, Any]) -> HeadEntry | None:
        """The spawned head, listed and the ask answered; None when the bound was met meanwhile."""
        with folder_lock(self.root):
            state = self._state()
            if len(state["heads"]) >= self.max_heads:
                self._write({**state, "spawn": None})
                return None
            taken = {h["name"] for h in state["heads"]}
            name = next(f"spawn{n}" for n in range(1, len(taken) + 2) if f"spawn{n}" not in taken)
            with atomic_dir(self.root / "heads" / name / "base") as staging:
                head.save(staging)
                atomic_write_json(staging / "meta.json", {"parent": parent, **metrics})
            entry = HeadEntry(name, str(self.root / "heads" / name / "base"), parent, time.time())
            self._write({**state, "heads": [*state["heads"], asdict(entry)], "spawn": None})
        return entry

    def _state(self) -> dict[str, Any]:
        path = self.root / HEADS
        if not path.is_file():
            return {"heads": [], "spawn": None}
        return json.loads(path.read_text())

    def _write(self, state: dict[str, Any]) -> None:
        atomic_write_json(self.root / HEADS, state)
