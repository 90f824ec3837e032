"""A duty cycle for work that shares its machine: rest after each unit so the work takes at most a share of time.

Why: on a host where the online trainer shares memory bandwidth and caches with a serving replica (a CPU node,
or a GPU the replica also uses), training back to back costs serving throughput; resting in proportion to each
optimizer step bounds that cost at about `duty` times the back-to-back cost, at `duty` times the training pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType


class DutyCycle:
    """`with cycle:` around each unit of work; leaving the block rests `elapsed * (1 / duty - 1)` seconds."""

    def __init__(self, duty: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"a duty cycle is a share of time in (0, 1], not {duty}")
        self.duty, self.clock, self.sleep = duty, clock, sleep
        self._started = 0.0

    def __enter__(self) -> DutyCycle:
        self._started = self.clock()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.duty < 1 and kind is None:
            self.sleep((self.clock() - self._started) * (1 / self.duty - 1))
