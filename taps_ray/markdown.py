"""The small pieces every written report shares (report/, interop/check.py, bench/, benchmarks/): a markdown
table, a number cell and the commit the report was made at. Here, below all of them, so that no report-writing
package imports another one sideways for its formatting."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Sequence

from taps_ray.relpaths import REPO

MISSING = "–"  # the cell of a value not measured


def fmt(value: float, digits: int = 2, suffix: str = "") -> str:
    return MISSING if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def git_commit() -> str:
    """The checkout's short commit, or "unknown" where git cannot say (no git, not a checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
