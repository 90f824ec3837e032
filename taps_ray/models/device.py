"""Which device a process computes on: the one resolution every model, head, batch and generator follows.

`target.device: auto` means the GPU when this process was given one: inside a Ray actor or task that is what
Ray granted it (`ray.get_gpu_ids()`, i.e. its `num_gpus`), since a CPU actor on a GPU node still sees the
node's GPUs; outside Ray it is whatever torch can use. `cuda` where there is none is a config error, and so
is a Ray grant of a GPU that torch cannot use (`gpu_check`): `auto` must not quietly put an 8B target on the CPU.
Ray is not imported here: a process that never imported it is no Ray worker, and the engine then runs where
Ray is not installed at all (benchmarks/gpu/gpu_smoke.py on a bare GPU machine).
"""

from __future__ import annotations

import sys

import torch

from taps_ray.config import ConfigError, TargetConfig
from taps_ray.models.gpu_check import GpuUnavailable, gpu_missing_message


def _ray_worker():
    """The `ray` module when this process is a Ray worker (an actor or task), else None."""
    ray = sys.modules.get("ray")  # a Ray worker imported Ray before running any of this project's code
    if ray is None or not ray.is_initialized():
        return None
    return ray if ray.get_runtime_context().worker.mode == ray.WORKER_MODE else None


def ray_gpu_ids() -> list:
    """The GPUs Ray granted this process ([] outside a Ray actor or task)."""
    ray = _ray_worker()
    return list(ray.get_gpu_ids()) if ray is not None else []


def gpu_granted() -> bool:
    """True when this process may use a GPU: Ray gave it one (in an actor or task), else torch sees one."""
    if not torch.cuda.is_available():
        return False
    ray = _ray_worker()
    return bool(ray.get_gpu_ids()) if ray is not None else True


def resolve_device(target: TargetConfig) -> torch.device:
    """The device `target.device` names in this process (auto: CUDA when granted a GPU, else the CPU). Raises
    `GpuUnavailable` when Ray granted a GPU that torch cannot use, unless the device is `cpu` on purpose."""
    if target.device == "cpu":
        return torch.device("cpu")
    granted = ray_gpu_ids()
    if granted and not torch.cuda.is_available():
        raise GpuUnavailable(gpu_missing_message(granted))
    if gpu_granted():
        return torch.device("cuda")
    if target.device == "cuda":
        raise ConfigError(
            "target.device is 'cuda' but this process has no GPU (torch.cuda.is_available() is False or Ray granted "
            "it none): set target.device to auto or cpu, or give the process a GPU (ray.target_num_gpus, "
            "ray.drafter_num_gpus, ray.trial_gpus, serve.replica_num_gpus)"
        )
    return torch.device("cpu")
