"""Peak CPU memory that tensors allocated during a block of code, from torch's own allocator accounting.

With `profile_memory`, torch's CPU allocator reports every allocation and free to the profiler together with
its running total of bytes allocated (`Total Allocated`), so the largest such total less the one the block
started from is the block's peak, transients included, exactly as the allocator saw it (no sampling). Allocations of other
threads are not reported: run the measured work on the calling thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_allocated(work: Callable[[], Any], scratch: Path) -> tuple[int, Any]:
    """(the peak bytes of tensors allocated while `work()` ran, what it returned)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    trace = scratch / "memory_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        raise RuntimeError("the profiler reported no CPU allocation: nothing ran, or it ran on another thread")
    # the allocator's total carries what an earlier profiled block allocated and freed unprofiled: start from it
    before = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - before, result
