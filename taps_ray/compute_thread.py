"""The one thread that runs a process's torch compute off its event loop (a Serve replica's decode loop, a target
worker's verification pool), with the process's torch thread count.

Why one, and why it also loads the model: two things OpenMP does with threads.
* The thread count is per thread. `torch.set_num_threads(n)` on one thread sets it there, and torch reports n
  everywhere, but a thread started later begins from OMP_NUM_THREADS (Ray sets it to an actor's CPUs): where the
  threads asked for differ from that (`ray.torch_threads`, a fractional `replica_num_cpus`), oneDNN's matmuls,
  most of a CPU decode step, ran on Ray's count, not on the one asked for.
* Every thread that runs a parallel region keeps a team of its own, and libgomp counts all their threads: with
  more of them than CPUs it stops spinning at barriers (`GOMP_SPINCOUNT` is then ignored) and every kernel's
  threads sleep and wake. SmolLM2-135M loaded on one thread and decoding on another ran its batch-16 fp32 step at
  1.3 CPUs in 131-138 ms against 1.9 CPUs in 103-106 ms on the loading thread (2-core Intel Xeon, an ad-hoc
  run; tests/test_compute_thread.py holds the thread counts).
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
