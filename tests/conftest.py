"""Shared fixtures: offline environment, the tiny random target, one Ray cluster per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve Ray actors on 2 cores

import pytest
import torch

from taps_ray.config import StudyConfig, TargetConfig, TinyTargetConfig, load_config
from taps_ray.machine import cpu_line
from taps_ray.models.target import Target, load_target
from taps_ray.ray_runtime import loopback_cluster

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

torch.set_num_threads(2)

# Devices the engine and lossless tests run on: the CPU always, CUDA where present. Every other fixture pins
# the CPU, so a GPU machine runs the same tests with the same numbers plus the CUDA copies.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The target forwards the lossless tests run on (`target.forward`): taps' own Llama forward and transformers'.
FORWARDS = ["fast", "hf"]


def pytest_report_header() -> str:
    """The CPU family picks the kernels, and so the rounding, of every numeric path the tests compare."""
    return cpu_line()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return Path(os.environ.get("TAPS_DATA_DIR", SHARED_DATA))


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> StudyConfig:
    config = load_config(REPO / "configs" / "tiny.yaml")
    work = tmp_path_factory.mktemp("tiny-work")
    target = config.target.model_copy(update={"device": "cpu"})
    return config.model_copy(update={"work_dir": str(work), "reports_dir": str(work / "reports"), "target": target})


@pytest.fixture(scope="session")
def tiny_target(tiny_config: StudyConfig) -> Target:
    return load_target(tiny_config.target)


@pytest.fixture(scope="session")
def prompts(tiny_target: Target) -> list[list[int]]:
    """Two short prompts for the tiny target: a sentence and a sum."""
    tok = tiny_target.tokenizer
    return [tok.encode("Hello there, how are you"), tok.encode("2+2=")]


@pytest.fixture(scope="session")
def tiny_variants(tiny_config: StudyConfig, tiny_target: Target) -> Callable[[str, str], Target]:
    """The tiny target (fp32) on a device with a target forward, each loaded once per session; `tiny_target` is
    the CPU one with the config's forward."""
    loaded = {("cpu", tiny_config.target.forward): tiny_target}

    def variant(device: str, forward: str) -> Target:
        if (device, forward) not in loaded:
            update = {"device": device, "forward": forward}
            loaded[device, forward] = load_target(tiny_config.target.model_copy(update=update))
        return loaded[device, forward]

    return variant


@pytest.fixture(scope="session", params=FORWARDS)
def forward_target(request: pytest.FixtureRequest, tiny_variants: Callable[[str, str], Target]) -> Target:
    """The tiny target on the CPU verifying with each target forward."""
    return tiny_variants("cpu", request.param)


@pytest.fixture(scope="session", params=[(d, f) for d in DEVICES for f in FORWARDS], ids=lambda p: "-".join(p))
def device_target(request: pytest.FixtureRequest, tiny_variants: Callable[[str, str], Target]) -> Target:
    """The tiny target on each available device with each target forward (fp32, as `tiny_target`)."""
    return tiny_variants(*request.param)


@pytest.fixture(scope="session", params=[(d, f) for d in DEVICES for f in FORWARDS], ids=lambda p: "-".join(p))
def smollm2_fp32(request: pytest.FixtureRequest) -> Target:
    device, forward = request.param
    return load_target(TargetConfig(name="smollm2-135m-instruct", dtype="float32", device=device, forward=forward))


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for the whole test session: a 2-CPU head on loopback, no dashboard. It is a
    `ray.cluster_utils.Cluster`, so the multi-node test adds (and removes) nodes to this same cluster."""
    import ray

    cluster = loopback_cluster(num_cpus=2, object_store_memory=512 * 1024**2)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The session's Ray module, connected to `ray_cluster`."""
    import ray

    return ray


@pytest.fixture(scope="session", params=FORWARDS)
def small_vocab_target(request: pytest.FixtureRequest) -> Target:
    """A 5-token random target with moderate distributions: exact joint probabilities are cheap to enumerate;
    one per target forward."""
    config = TargetConfig(
        name="tiny-random-llama",
        dtype="float32",
        tiny=TinyTargetConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=5, seed=3),
        device="cpu",
        forward=request.param,
    )
    target = load_target(config)
    with torch.no_grad():  # moderate, non-degenerate next-token distributions
        target.model.model.embed_tokens.weight.mul_(0.25)
    return target
