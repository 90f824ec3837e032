"""Why a process that Ray granted a GPU sees none, said in one line.

Ray hands a node the GPU count its config declares (cluster.yaml's `"GPU": N`), whether or not the container
can reach the devices, and a torch wheel built without CUDA (or for a newer CUDA than the node's driver)
reports no device either. Without this check `target.device: auto` would then put an 8B target on the CPU and
the study would crawl instead of failing; `device.resolve_device` raises with this diagnosis instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import torch

DRIVER_FILE = Path("/proc/driver/nvidia/version")


class GpuUnavailable(RuntimeError):
    """Ray granted this process a GPU, but torch can use none."""


def driver_version() -> str | None:
    """The NVIDIA driver this process can reach: /proc's version line, else nvidia-smi's; None when neither."""
    if DRIVER_FILE.is_file():
        first = DRIVER_FILE.read_text().splitlines()[:1]
        if first:
            return " ".join(first[0].split())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip().replace("\n", "; ") or None


def node_name() -> str:
    """Hostname and the address Ray knows the node by (the hostname alone inside a container is its id)."""
    host = socket.gethostname()
    try:
        import ray

        return f"{host} ({ray.util.get_node_ip_address()})"
    except Exception:  # no Ray here: the hostname is all there is
        return host


def gpu_missing_message(gpu_ids: list) -> str:
    """One line: the node, what was checked, and the fix that follows from it."""
    cuda_build = torch.version.cuda
    driver = driver_version()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    checked = (f"torch {torch.__version__} with torch.version.cuda={cuda_build}"
               f"{' (a CPU build)' if cuda_build is None else ''}, NVIDIA driver: "
               f"{driver or 'none found (no /proc/driver/nvidia/version, no nvidia-smi)'}, "
               f"CUDA_VISIBLE_DEVICES={visible}")
    if cuda_build is None:
        fix = ("install torch's CUDA wheel matching the image's CUDA (cluster.yaml setup_commands: "
               "pip install torch==<version> --index-url https://download.pytorch.org/whl/cu<NNN>)")
    elif driver is None:
        fix = ("expose the GPUs to the container (cluster.yaml docker run_options: --gpus all, on a host with the "
               "NVIDIA driver and container toolkit)")
    else:
        fix = (f"use a driver that supports CUDA {cuda_build} or torch's wheel for the driver's CUDA, changing "
               "the image tag and the wheel index together (docs/cluster.md)")
    return (f"Ray granted this process GPU(s) {list(gpu_ids)} on node {node_name()} but torch.cuda.is_available() "
            f"is False; checked {checked}: {fix}; or, to run on the CPU on purpose, set target.device: cpu and "
            "request no GPU")
