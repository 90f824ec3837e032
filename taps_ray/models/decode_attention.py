"""A one-token decode step's attention on the CPU over each row's own keys: a small C++ kernel
(`decode_attention.cpp`), built for this machine on first use and kept in torch's extension directory.

Why: at a batch of ragged sequences the cache is as wide as the longest one, and torch's CPU attention computes
every padded key (the mask only zeroes them), after a fixed ~75 µs a call. The kernel gathers each row's
attended keys once for the query heads that share them and computes over those alone. Measured on an AMD EPYC
(2 threads, SmolLM2-135M's shapes: 3 key/value heads of 3 query heads, head size 64; bf16; ad hoc): 118 against
354 µs a layer at batch 16 (lengths 60-230), 32 against 71 at batch 4, 14 against 25 at batch 1; float32 alike.
It does not pay for trees or prefills (each query row re-reads the keys: no faster than SDPA from 4 query
positions up), so those keep SDPA (`models/sdpa.py`), as does CUDA.

Built by torch's extension builder with `-march=native`, as a library named by the source, torch's version, the
flags and the CPU's feature flags, so a cache shared between machines never runs code built for another CPU.
Where it cannot be built (no C++ compiler or ninja), the forward warns once and keeps SDPA, which computes the
same.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")  # fast math at compile time only: not linked in
HEAD_DIMS = (16, 32, 64, 128)  # the kernel's compiled head sizes
DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger(__name__)
_LOADING = threading.Lock()

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


def covers(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a forward on `device` in `dtype` with heads of `head_dim` may take the kernel."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def _cpu_features() -> str:
    """The CPU's feature flags (what `-march=native` compiles for); empty where /proc/cpuinfo is not there."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def build_name() -> str:
    """The extension's name: one build per source, torch, flags and CPU."""
    key = "\n".join([SOURCE.read_text(), torch.__version__, " ".join(FLAGS), _cpu_features()])
    return "taps_decode_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def build_directory() -> Path:
    """Where built kernels are kept: torch's extension directory (`TORCH_EXTENSIONS_DIR`, by default
    ~/.cache/torch_extensions), under taps/."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "taps"


def _build_and_load(name: str) -> None:
    """Load the built library, or build it in a directory of this process's own and move it into place
    atomically: torch's builder locks a shared directory with a file that a process killed mid-build would leave
    behind, and every later process would wait on it forever."""
    from torch.utils.cpp_extension import load

    library = build_directory() / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=f"{name}-build-") as private:
        load(name=name, sources=[str(SOURCE)], extra_cflags=list(FLAGS), build_directory=private,
             is_python_module=False)
        os.replace(Path(private) / library.name, library)


@functools.cache
def kernel() -> Kernel | None:
    """`taps::decode_attention(queries [B, H, R, D], keys, values [B, H, S, D], additive mask [B, 1, 1, S] or
    None, scale)`, built and loaded once a process; None (with a warning) where it cannot be built."""
    with _LOADING:  # two threads' first calls: one builds and loads, the other then finds the op
        return _loaded()


def _loaded() -> Kernel | None:
    if not hasattr(torch.ops.taps, "decode_attention"):
        try:
            _build_and_load(build_name())
        except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a failed build
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            log.warning("taps: the CPU decode-attention kernel could not be built (%s); decode steps use torch's "
                        "SDPA, which computes the same, slower. Install a C++ compiler and ninja (Debian: "
                        "apt-get install g++ ninja-build) to build it.", reason)
            return None
    return torch.ops.taps.decode_attention
