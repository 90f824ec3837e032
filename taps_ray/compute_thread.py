"""The one thread that runs a process's torch compute off its event loop (a Serve replica's decode loop, a target
worker's verification pool), with the process's torch thread count.

Why one, and why it also loads the model: OpenMP keeps two things per process that a second computing thread
breaks.
* The thread count is per thread. `torch.set_num_threads(n)` on one thread sets it there, and torch reports n
  everywhere, but a thread started later begins from OMP_NUM_THREADS (Ray sets it to an actor's CPUs, or 1):
  oneDNN's matmuls, most of a CPU decode step, ran on one thread in a replica given two.
* Every thread that runs a parallel region keeps a team of its own, and libgomp counts all their threads: with
  more of them than CPUs it stops spinning at barriers (`GOMP_SPINCOUNT` is then ignored) and every kernel's
  threads sleep and wake. A replica that loaded its model on one thread and decoded on another ran its batch-16
  fp32 step at 1.3 CPUs in 131-138 ms against 1.9 CPUs in 103-106 ms for the same step on the loading thread
  (2-core Intel Xeon; tests/test_compute_thread.py holds the thread counts).
So the thread is made first, with its thread count, and the model is loaded on it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def compute_executor(name: str, threads: int | None = None) -> ThreadPoolExecutor:
    """One worker thread named `name` that computes with `threads` torch (and OpenMP) threads, by default the
    count the calling thread has now. Load the model on it (`executor.submit(load).result()`), then compute."""
    count = threads or torch.get_num_threads()
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(count,))
