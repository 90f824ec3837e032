"""The compute thread keeps the process's torch thread count and the process's one OpenMP team
(taps_ray/compute_thread.py). Each check runs in a fresh interpreter: libgomp reads OMP_NUM_THREADS once, at
load, and keeps its thread pools for the process's life."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# OpenMP's own view of a thread (not torch's, which reads a process-wide number), and the process's OS threads
PROBE = textwrap.dedent("""
    import ctypes, json, os
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from taps_ray.compute_thread import compute_executor

    gomp = [line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line]
    if not gomp:
        print(json.dumps({"skip": "torch here does not use libgomp"}))
        raise SystemExit
    omp_threads = ctypes.CDLL(gomp[0]).omp_get_max_threads
    os_threads = lambda: len(os.listdir("/proc/self/task"))
    torch.set_num_threads(2)
    plain = ThreadPoolExecutor(1).submit(omp_threads).result()
    compute = compute_executor("compute")
    ours = compute.submit(omp_threads).result()
    before = os_threads()
    weight, x = torch.randn(1024, 1024), torch.randn(64, 1024)
    compute.submit(lambda: (x @ weight).sum()).result()  # the compute thread's team: one more OS thread
    after_compute = os_threads()
    (x @ weight).sum()  # a second thread computing: a second team
    print(json.dumps({"plain": plain, "ours": ours, "team": after_compute - before,
                      "second_team": os_threads() - after_compute}))
""")


def _probe() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_compute_thread_computes_with_the_process_s_threads_where_a_plain_thread_gets_openmp_s_default():
    probe = _probe()
    if "skip" in probe:
        pytest.skip(probe["skip"])
    assert probe["plain"] == 1  # the bug: a later thread starts from OMP_NUM_THREADS, whatever torch says
    assert probe["ours"] == 2
    # its parallel regions start one OpenMP worker beside it, and a second computing thread starts another
    # team (what libgomp counts against the CPUs before it stops spinning): the reason to load on this thread
    assert probe["team"] == 1
    assert probe["second_team"] == 1
