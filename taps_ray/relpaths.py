"""How a path is printed in anything that may be committed (reports, source labels): never machine-absolute.

A clone elsewhere must read the same text, so a path is shown relative to the data dir (as
``$TAPS_DATA_DIR/...``), else relative to the repository, else by its last two parts only.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_DIR_VAR = "$TAPS_DATA_DIR"


def _inside(path: Path, folder: Path) -> str | None:
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return None


def shown_path(path: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> str:
    """`path` for printing: a relative path as given; an absolute one under `data_dir` as ``$TAPS_DATA_DIR/...``,
    under the repository relative to it, and anywhere else as ``…/<parent>/<name>``."""
    given = Path(path).expanduser()
    if not given.is_absolute():
        return given.as_posix()
    resolved = given.resolve()
    if data_dir is not None:
        inside = _inside(resolved, Path(data_dir).expanduser().resolve())
        if inside is not None:
            return f"{DATA_DIR_VAR}/{inside}" if inside != "." else DATA_DIR_VAR
    inside = _inside(resolved, REPO)
    if inside is not None:
        return inside
    return "…/" + "/".join(resolved.parts[-2:])
