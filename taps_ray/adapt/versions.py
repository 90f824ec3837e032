"""Published head versions of one served model: what the trainer publishes and the replicas load.

    <folder>/current.json   {"version": n, "path": ..., "previous": m, "metrics": {...}, "rejected": [...]}
    <folder>/v0001/         a published head (DraftHead.save) and its meta.json

Version 0 is the head the replica started with (the work dir's trained head). A version folder is written with
`atomic_dir` before `current.json` (written atomically) names it, so a replica never reads half a head. The
pointer's read-modify-write holds the folder's lock: the trainer publishing and a replica rolling back are
serialised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taps_ray.fsio import atomic_dir, atomic_write_json, folder_lock
from taps_ray.models.draft_head import DraftHead

CURRENT = "current.json"


@dataclass(frozen=True)
class Version:
    number: int
    path: Path
    previous: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


class VersionStore:
    def __init__(self, folder: str | Path, base: str | Path) -> None:
        """`base`: version 0, the head the service loads from its work dir."""
        self.folder, self.base = Path(folder), Path(base)
        self.folder.mkdir(parents=True, exist_ok=True)

    def current(self) -> Version:
        state = self._state()
        return self._version(state["version"], state)

    def rejected(self) -> list[int]:
        """The versions rolled back, never served again."""
        return list(self._state()["rejected"])

    def version(self, number: int) -> Version:
        return self._version(number, self._state())

    def publish(self, head: DraftHead, metrics: dict[str, Any], over: int) -> Version | None:
        """Save `head` as the next version and make it current, its `previous` the served one; only while the served
        version is still `over`, the one the candidate was scored against (None otherwise: a replica rolled back
        meanwhile, and the candidate is stale)."""
        with folder_lock(self.folder):
            state = self._state()
            if state["version"] != over:
                return None
            number = max([state["version"], *state["rejected"], *self._numbers()]) + 1
            with atomic_dir(self._path(number)) as staging:
                head.save(staging)
                atomic_write_json(staging / "meta.json", {"previous": state["version"], **metrics})
            self._write({**state, "version": number, "previous": state["version"], "metrics": metrics})
        return self.current()

    def roll_back(self, bad: int) -> Version:
        """Make `bad`'s previous version current again and never serve `bad` again (a no-op unless `bad` is
        current: another replica may have rolled it back already)."""
        with folder_lock(self.folder):
            state = self._state()
            if state["version"] == bad and state.get("previous") is not None:
                previous = self._meta(bad).get("previous", 0)
                self._write({**state, "version": previous, "previous": self._meta(previous).get("previous"),
                             "rejected": sorted({*state["rejected"], bad})})
        return self.current()

    # -- internals -------------------------------------------------------------------------------------------

    def _path(self, number: int) -> Path:
        return self.base if number == 0 else self.folder / f"v{number:04d}"

    def _numbers(self) -> list[int]:
        return [int(p.name[1:]) for p in self.folder.glob("v[0-9][0-9][0-9][0-9]") if p.is_dir()]

    def _meta(self, number: int) -> dict[str, Any]:
        path = self._path(number) / "meta.json"
        return json.loads(path.read_text()) if number and path.is_file() else {}

    def _state(self) -> dict[str, Any]:
        path = self.folder / CURRENT
        if not path.is_file():
            return {"version": 0, "previous": None, "metrics": {}, "rejected": []}
        return json.loads(path.read_text())

    def _version(self, number: int, state: dict[str, Any]) -> Version:
        meta = state.get("metrics", {}) if number == state["version"] else self._meta(number)
        previous = state.get("previous") if number == state["version"] else self._meta(number).get("previous")
        return Version(number, self._path(number), previous, meta)

    def _write(self, state: dict[str, Any]) -> None:
        atomic_write_json(self.folder / CURRENT, state)
