"""Device resolution (`target.device`), the clear failure of a CUDA request without a GPU, and a guard that
engine code names the device of every tensor it creates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from taps_ray.config import ConfigError, TargetConfig
from taps_ray.models.device import resolve_device
from taps_ray.models.gpu_check import GpuUnavailable
from taps_ray.models.target import load_target
from taps_ray.ray_runtime import OMP_WAIT_ENV, process_runtime_env
from taps_ray.serve.app import build_app

REPO = Path(__file__).resolve().parents[1]
CONSTRUCTORS = {"tensor", "zeros", "ones", "full", "arange", "eye", "empty", "rand", "randn", "randint", "Generator"}


def test_auto_is_the_cpu_without_a_gpu_and_cpu_is_always_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(TargetConfig(device="auto")) == torch.device("cpu")
    assert resolve_device(TargetConfig(device="cpu")) == torch.device("cpu")
    assert resolve_device(TargetConfig()) == torch.device("cpu")  # auto is the default


def test_auto_follows_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # outside Ray: what torch sees
    assert resolve_device(TargetConfig(device="auto")) == torch.device("cuda")
    assert resolve_device(TargetConfig(device="cpu")) == torch.device("cpu")


def test_asking_for_cuda_without_one_fails_with_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = TargetConfig(name="tiny-random-llama", dtype="float32", device="cuda")
    with pytest.raises(ConfigError) as error:
        load_target(config)
    message = str(error.value)
    assert "\n" not in message
    assert "target.device is 'cuda'" in message and "set target.device to auto or cpu" in message
    assert "num_gpus" in message


def test_unknown_device_is_a_config_error():
    with pytest.raises(ValueError, match="device"):
        TargetConfig(device="tpu")


def test_a_ray_task_without_gpus_resolves_auto_to_the_cpu(ray_session):
    @ray_session.remote(num_cpus=0, num_gpus=0)
    def where() -> str:
        return str(resolve_device(TargetConfig(device="auto")))

    assert ray_session.get(where.remote()) == "cpu"


def test_an_actor_granted_a_gpu_that_torch_cannot_use_fails_at_start_naming_node_checks_and_fix(ray_cluster,
                                                                                                 ray_session):
    """Ray grants a node's declared GPUs whether or not torch can use them (this torch is a CPU build): the
    actor must stop at start, not load the target on the CPU."""
    ray = ray_session
    node = ray_cluster.add_node(num_cpus=1, num_gpus=1, resources={"fake_gpu_node": 1.0}, node_ip_address="127.0.0.1")
    try:
        @ray.remote(num_cpus=0, num_gpus=1, resources={"fake_gpu_node": 1.0}, max_restarts=0)
        class Loader:
            def __init__(self, device: str) -> None:
                self.device = str(resolve_device(TargetConfig(device=device)))

            def where(self) -> str:
                return self.device

        assert ray.get(Loader.remote("cpu").where.remote()) == "cpu"  # the CPU on purpose stays allowed
        with pytest.raises(ray.exceptions.RayActorError) as error:
            ray.get(Loader.remote("auto").where.remote())
    finally:
        ray_cluster.remove_node(node)
    message = next(line for line in str(error.value).splitlines() if "GpuUnavailable: " in line)
    assert "Ray granted this process GPU(s) [" in message and "127.0.0.1" in message  # the node, by address
    assert f"torch.version.cuda={torch.version.cuda}" in message and "NVIDIA driver:" in message
    assert "CUDA_VISIBLE_DEVICES=0" in message  # what Ray set for its grant
    assert "install torch's CUDA wheel" in message and "target.device: cpu" in message  # the fix for a CPU build


def test_the_fix_follows_what_is_missing(monkeypatch):
    from taps_ray.models import gpu_check

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(gpu_check, "driver_version", lambda: None)
    assert "expose the GPUs to the container" in gpu_check.gpu_missing_message([0])
    monkeypatch.setattr(gpu_check, "driver_version", lambda: "NVRM version: 535.104")
    message = gpu_check.gpu_missing_message([0])
    assert "NVRM version: 535.104" in message and "supports CUDA 12.8" in message and "\n" not in message


def test_serve_replicas_reserve_the_configured_gpus(tiny_config):
    serve_cfg = tiny_config.serve.model_copy(update={"replica_num_gpus": 0.5, "replica_memory_gb": 3.0,
                                                     "replica_resources": {"accelerator_type:L40S": 0.001}})
    app = build_app(tiny_config.model_copy(update={"serve": serve_cfg}))
    options = dict(app._bound_deployment.ray_actor_options)
    # the driver's settings and Hub token, as every actor, and the replica's OpenMP wait
    assert options.pop("runtime_env") == process_runtime_env(OMP_WAIT_ENV[serve_cfg.replica_omp_wait])
    assert options == {"num_cpus": serve_cfg.replica_num_cpus, "num_gpus": 0.5, "memory": 3_000_000_000,
                       "resources": {"accelerator_type:L40S": 0.001}}


def _deviceless_constructors(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in CONSTRUCTORS
            and not any(k.arg == "device" for k in node.keywords)
        ):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} torch.{node.func.attr}")
    return found


def test_engine_serve_and_bench_name_the_device_of_every_tensor_and_generator():
    files = [*(p for package in ("drafting", "decoding", "serve")
               for p in sorted((REPO / "taps_ray" / package).glob("*.py"))),
             REPO / "taps_ray" / "bench" / "run.py", REPO / "taps_ray" / "training" / "losses.py"]
    assert len(files) > 10, "the scan found no engine modules: the check would be blind"
    offenders = [hit for path in files for hit in _deviceless_constructors(path)]
    assert offenders == [], f"give these device= (the model's, or the tree's): {offenders}"
