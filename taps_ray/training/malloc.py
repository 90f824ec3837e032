"""Keep training's memory flat in corpus size: pin glibc's mmap threshold.

Training streams feature windows (a few shards of tensors, megabytes each) and frees each before the next.
glibc serves large blocks with mmap, but raises its mmap threshold to the size of every such block freed
(up to 32 MB); afterwards windows and batches are carved from the heap, whose free space fragments and is
not returned, so the peak resident set creeps up with every window, that is with corpus size. Pinning the
threshold at glibc's initial 128 KiB (setting it turns the adjustment off) hands every large block back to
the OS when freed. Measured in reports/memory.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt parameter number, <malloc.h>
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold for this process; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
