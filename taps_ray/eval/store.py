"""The parquet results store: one folder per evaluated cell, written atomically, so sweeps resume safely.

A cell's folder holds `steps.parquet` (one row per decoding step) and `questions.parquet` (one row per
question and turn); `done.json` is written last and is what marks the cell finished. A cell that failed
for good leaves `failed.json` with its error. Readers only ever see complete files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from taps_ray.eval.cell import Cell
from taps_ray.fsio import atomic_write_json, atomic_write_parquet


class ResultsStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def cell_dir(self, cell: Cell) -> Path:
        return self.root / "cells" / cell.id

    def is_done(self, cell: Cell) -> bool:
        return (self.cell_dir(cell) / "done.json").is_file()

    def write_cell(self, cell: Cell, steps: list[dict], questions: list[dict], meta: dict | None = None) -> None:
        """A finished cell's step and question records (`eval.runner.run_cell`), as parquet frames."""
        folder = self.cell_dir(cell)
        atomic_write_parquet(folder / "steps.parquet", pd.DataFrame(steps))
        atomic_write_parquet(folder / "questions.parquet", pd.DataFrame(questions))
        (folder / "failed.json").unlink(missing_ok=True)
        atomic_write_json(folder / "done.json", {**cell.as_dict(), **(meta or {})})

    def write_failure(self, cell: Cell, error: str, attempts: int) -> None:
        record = {**cell.as_dict(), "error": error, "attempts": attempts}
        atomic_write_json(self.cell_dir(cell) / "failed.json", record)

    def failures(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.root.glob("cells/*/failed.json"))]

    def meta(self) -> list[dict]:
        """done.json of every finished cell: the cell plus what the evaluator recorded (dtype, device)."""
        return [json.loads(p.read_text()) for p in sorted(self.root.glob("cells/*/done.json"))]

    def _done_dirs(self) -> list[Path]:
        return sorted(p.parent for p in self.root.glob("cells/*/done.json"))

    def _concat(self, name: str) -> pd.DataFrame:
        frames = [pd.read_parquet(folder / name) for folder in self._done_dirs()]
        frames = [f for f in frames if not f.empty]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def questions(self) -> pd.DataFrame:
        return self._concat("questions.parquet")

    def steps(self) -> pd.DataFrame:
        return self._concat("steps.parquet")
