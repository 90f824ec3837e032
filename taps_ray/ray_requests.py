"""What each kind of Ray actor or task of a study asks Ray for, in one place.

A target worker, a features (or agreement) task, a drafter, a Tune trial and a Serve replica each reserve CPUs,
GPUs, host memory (Ray's `memory`, bytes) and custom resources (`accelerator_type:A100`, ...) from the config.
Every place that starts one takes its request from here, and so does `taps plan` (`taps_ray.plan`): an actor's
placement-group bundle, its `.options(...)`, a trial's one-bundle `PlacementGroupFactory` and the plan's table cannot
disagree. A bundle must hold all of what its actor asks for, memory included: Ray rejects an actor whose
request does not fit its bundle's shape ("cannot fit into any bundles") only when the actor is created, long
after the features and training stages have run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from taps_ray.config import StudyConfig, memory_bytes

KINDS = ("target_worker", "drafter", "features_task", "tune_trial", "serve_replica")


@dataclass(frozen=True)
class RayRequest:
    """One actor's or task's reservation."""

    num_cpus: float
    num_gpus: float
    memory: int | None = None  # bytes; None: not declared
    resources: dict[str, float] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `.options(...)` of a Ray actor or task (and Serve's `ray_actor_options`)."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources)}
        if self.memory is not None:
            out["memory"] = self.memory
        return out

    def bundle(self) -> dict[str, float]:
        """The same reservation as a placement-group bundle, in Ray's resource names (zero amounts dropped:
        Ray rejects them; an actor that asks for nothing holds a token CPU share, as Ray rejects empty bundles)."""
        amounts = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory or 0, **self.resources}
        return {name: amount for name, amount in amounts.items() if amount > 0} or {"CPU": 0.01}


def target_worker(cfg: StudyConfig) -> RayRequest:
    r = cfg.ray
    return RayRequest(r.target_num_cpus, r.target_num_gpus, memory_bytes(r.target_memory_gb), dict(r.target_resources))


def features_task(cfg: StudyConfig) -> RayRequest:
    """A features (or held-out agreement) task holds the whole target, as a target worker does."""
    return target_worker(cfg)


def drafter(cfg: StudyConfig) -> RayRequest:
    r = cfg.ray
    return RayRequest(r.drafter_num_cpus, r.drafter_num_gpus, memory_bytes(r.drafter_memory_gb), dict(r.drafter_resources))


def tune_trial(cfg: StudyConfig) -> RayRequest:
    r = cfg.ray
    return RayRequest(r.trial_cpus, r.trial_gpus, memory_bytes(r.trial_memory_gb), dict(r.trial_resources))


def serve_replica(cfg: StudyConfig) -> RayRequest:
    s = cfg.serve
    return RayRequest(s.replica_num_cpus, s.replica_num_gpus, memory_bytes(s.replica_memory_gb), dict(s.replica_resources))


def request_of(cfg: StudyConfig, kind: str) -> RayRequest:
    """The request of actor kind `kind` (one of `KINDS`)."""
    makers = {"target_worker": target_worker, "drafter": drafter, "features_task": features_task,
              "tune_trial": tune_trial, "serve_replica": serve_replica}
    if kind not in makers:
        raise ValueError(f"unknown actor kind {kind!r}; use one of {', '.join(KINDS)}")
    return makers[kind](cfg)
