"""Training pins glibc's mmap threshold, so a freed feature window goes back to the OS."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Run in a fresh interpreter: in the test session's own process, earlier tests leave free chunks in the heap that
# glibc serves a 16 MB request from (no mmap, nothing returned on free) whatever the threshold, so the check would
# depend on test order. A training process pins the threshold at startup, as this script does.
CHECK = """
import psutil, torch
from taps_ray.training.malloc import pin_mmap_threshold
assert pin_mmap_threshold()
process = psutil.Process()
for _ in range(3):  # unpinned, glibc would raise its threshold after the first free and keep later blocks
    window = torch.ones(4 * 2**20)  # 16 MB, as a window of feature shards
    held = process.memory_info().rss
    del window
    released = held - process.memory_info().rss
    assert released > 12 * 2**20, f"only {released} bytes went back to the OS"
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_windows_return_to_the_os() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
