"""Which machine a figure or a test run came from: the CPU model and the instruction sets that change its kernels.

The project's machines are not one CPU family (Intel with AMX, AMD EPYC with AVX-512 and no AMX): fp32 and bf16
kernels round differently across them and run at different speeds, so CI's log and every benchmark report say
which one they ran on. Standard library only: `.ci/run` prints this before the project's venv exists
(`python3 -m taps_ray.machine`).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The instruction-set extensions that pick different fp32/bf16 kernels (oneDNN, MKL, inductor).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo, or what `platform` knows elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model or platform.machine() or "unknown CPU", flags


def has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles. It picks `train.precision: auto` (bf16-mixed training with AMX; without
    it autocast's bf16 training measured slower than fp32) and the one-row fp32 kernel (models/cpu_linear.py). Bf16
    inference through oneDNN's packed weights outruns fp32 on AVX512-BF16 as well: that is `native_bf16`."""
    return "amx_bf16" in _cpuinfo()[1]


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), rather than converting to fp32 first."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpuinfo()[1])


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_line() -> str:
    """One line for logs and report headers, e.g. 'CPU: AMD EPYC, x86_64, 2 cores; avx2 avx512f avx512_bf16; no AMX'."""
    model, flags = _cpuinfo()
    present = [f for f in KERNEL_FLAGS if f in flags]
    amx = "AMX" if any(f.startswith("amx") for f in present) else "no AMX"
    listed = " ".join(present) if present else "no AVX2/AVX-512 flags seen"
    return f"CPU: {model}, {platform.machine()}, {os.cpu_count()} cores; {listed}; {amx}"


def omp_wait_line() -> str:
    """How this process's idle OpenMP threads wait between kernels, as libgomp read it when torch loaded: a
    batch-1 step with them sleeping at once took up to 2x as long as with OpenMP's own spin
    (reports/decode_threads.md), so a report that times our loop says which."""
    policy, spins = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
    if spins is not None:  # libgomp spins this many times before sleeping, whatever the policy says
        return f"GOMP_SPINCOUNT={spins}" + (f" (OMP_WAIT_POLICY={policy})" if policy else "")
    return f"OMP_WAIT_POLICY={policy}" if policy else "OpenMP's own wait, as a serve replica's"


if __name__ == "__main__":
    print(cpu_line())
