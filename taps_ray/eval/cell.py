"""What one evaluation is: a `Cell`, and the names plain decoding goes by in cells.

Kept apart from the results store and the summaries (which build pandas frames) so that a Ray drafter, which
evaluates cells and returns plain records, never imports pandas.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PLAIN = "plain"  # the proposer of plain decoding, every cell's speed baseline
NO_HEAD = "none"  # the head kind of cells whose proposer uses no head


@dataclass(frozen=True)
class Cell:
    """One evaluation: a proposer of one head kind on one benchmark at one temperature."""

    head_kind: str
    proposer: str
    benchmark: str
    temperature: float

    @property
    def id(self) -> str:
        return f"{self.head_kind}__{self.proposer}__{self.benchmark}__T{self.temperature:g}"

    def as_dict(self) -> dict:
        return asdict(self)
