"""The traffic buffer: recorded sequences in the training feature format, bounded, atomic and resumable.

One folder per adapted model. Each flush is one shard (`training.features.write_shard`: input ids, loss mask,
bf16 post-norm features; no top-K, the trainer derives it from the target's LM head), written under a temporary
name and renamed; `index.json` (written atomically after the shard) lists the live shards in arrival order. A
shard the index does not list (a writer killed between the two renames) or a temporary file is removed when the
buffer is opened, so a restarted replica or trainer resumes from the last complete index. Old shards age out: the
oldest go first while the buffer holds more than `max_tokens` positions or they are older than `max_age_s`.
Writers (replicas) hold the folder's lock for the index update; readers (the trainer) read the index and skip a
shard that aged out meanwhile. Each example may carry a tag (a small JSON dict, in the shard's metadata): a routed
model's recordings say which head drafted them and whether they decoded below the spawn threshold, so a head trains
on its own traffic and a spawned head on the low requests only (`read(where=...)`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from taps_ray.fsio import atomic_write_json, folder_lock
from taps_ray.training.features import Example, read_shard, read_shard_meta, write_shard

Tag = dict[str, Any]  # what a writer says about one example (JSON)
INDEX = "index.json"
SETTLE_S = 60.0  # an unlisted file younger than this may be another writer's shard between its two renames


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    created: float


class TrafficBuffer:
    def __init__(self, folder: str | Path, max_tokens: int, max_age_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.folder = Path(folder)
        self.max_tokens, self.max_age_s, self.clock = max_tokens, max_age_s, clock
        self.folder.mkdir(parents=True, exist_ok=True)
        with folder_lock(self.folder):
            self._recover()

    def shards(self) -> list[Shard]:
        """The live shards, oldest first (the index as last written)."""
        path = self.folder / INDEX
        if not path.is_file():
            return []
        return [Shard(**s) for s in json.loads(path.read_text())["shards"]]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards())

    def add(self, examples: Sequence[Example], tags: Sequence[Tag] | None = None) -> Shard | None:
        """Write `examples` (with their `tags`, one each) as one shard, list it, then age out what the bounds no
        longer allow."""
        if not examples:
            return None
        now = self.clock()
        shard = Shard(f"shard-{time.time_ns()}-{uuid.uuid4().hex[:8]}.safetensors", sum(len(e) for e in examples), now)
        meta = {"created": now, "tags": list(tags) if tags is not None else [{} for _ in examples]}
        write_shard(self.folder / shard.file, examples, meta)
        with folder_lock(self.folder):
            kept = self._age_out([*self.shards(), shard], now)
            self._write_index(kept)
        return shard

    def read(self, shards: Sequence[Shard] | None = None, where: Callable[[Tag], bool] | None = None) -> list[Example]:
        """The examples of `shards` (default: all live ones) in arrival order, only those whose tag `where` accepts;
        a shard aged out meanwhile is skipped."""
        out = []
        for shard in self.shards() if shards is None else shards:
            path = self.folder / shard.file
            try:
                examples = read_shard(path)
                tags = read_shard_meta(path)[1].get("tags") or [{} for _ in examples]
            except FileNotFoundError:
                continue
            out.extend(e for e, tag in zip(examples, tags, strict=True) if where is None or where(tag))
        return out

    def _age_out(self, shards: list[Shard], now: float) -> list[Shard]:
        kept = [s for s in shards if self.max_age_s is None or now - s.created <= self.max_age_s]
        while len(kept) > 1 and sum(s.tokens for s in kept) > self.max_tokens:
            kept.pop(0)
        for gone in {s.file for s in shards} - {s.file for s in kept}:
            (self.folder / gone).unlink(missing_ok=True)
        return kept

    def _write_index(self, shards: list[Shard]) -> None:
        atomic_write_json(self.folder / INDEX, {"shards": [asdict(s) for s in shards]})

    def _recover(self) -> None:
        """Drop what a killed writer left (temporary files and shards the index does not list, once older than
        `SETTLE_S`) and index entries whose shard is missing."""
        listed = self.shards()
        names = {s.file for s in listed}
        settled = time.time() - SETTLE_S
        for path in self.folder.iterdir():
            if path.name != INDEX and path.name not in names and path.stat().st_mtime < settled:
                path.unlink(missing_ok=True)
        present = [s for s in listed if (self.folder / s.file).is_file()]
        if present != listed:
            self._write_index(present)
