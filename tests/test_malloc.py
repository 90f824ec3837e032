"""Training pins glibc's mmap threshold, so a freed feature window goes back to the OS."""

from __future__ import annotations

import platform

import psutil
import pytest
import torch

from taps_ray.training.malloc import pin_mmap_threshold


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_windows_return_to_the_os() -> None:
    assert pin_mmap_threshold()
    process = psutil.Process()
    for _ in range(3):  # unpinned, glibc would raise its threshold after the first free and keep later blocks
        window = torch.ones(4 * 2**20)  # 16 MB, as a window of feature shards
        held = process.memory_info().rss
        del window
        assert held - process.memory_info().rss > 12 * 2**20
