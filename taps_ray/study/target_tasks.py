"""Work that runs the target model as Ray tasks with the target's resources (`ray.target_*`: a GPU on a cluster).

* `on_target`: one job, e.g. the held-out agreement of the trained heads.
* `extract_feature_sets`: feature extraction (and answer regeneration, which runs inside it) spread over the
  cluster. The driver holds a set's lock and cuts it into shards (`training.features.plan_shards`); the
  missing shards are dealt round-robin to `features.num_workers` tasks, each loading the target once and
  writing its own shards (`extract_shards`); once every shard exists the driver writes the manifest. A task
  that Ray retries (its node died) skips the shards it already wrote; so does a rerun of a killed sweep.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from taps_ray import ray_requests
from taps_ray.config import StudyConfig, parse_config
from taps_ray.models.target import load_target
from taps_ray.ray_runtime import prepare_process, process_runtime_env
from taps_ray.training.features import extract_features, extract_shards


@ray.remote
def _run_on_target(payload: str, job: Callable[..., Any], args: tuple) -> Any:
    cfg = parse_config(json.loads(payload), "<driver>")
    threads = prepare_process(cfg.ray.torch_threads, cfg.ray.target_num_cpus)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return job(cfg, load_target(cfg.target), *args)


def _target_task(cfg: StudyConfig, env: dict[str, str], job: Callable[..., Any], *args: Any) -> ray.ObjectRef:
    """`job(cfg, target, *args)` submitted as a Ray task with the target's resources."""
    task = _run_on_target.options(**ray_requests.features_task(cfg).options(), runtime_env=process_runtime_env(env))
    return task.remote(cfg.model_dump_json(), job, args)


def on_target(cfg: StudyConfig, env: dict[str, str], job: Callable[..., Any], *args: Any) -> Any:
    """`job(cfg, target, *args)` in one Ray task with the target's resources; its result."""
    return ray.get(_target_task(cfg, env, job, *args))


# --- features ---------------------------------------------------------------------------------------------------


def _extract_part(cfg: StudyConfig, target: Any, folder: str, spec: dict, shards: list) -> tuple[int, int]:
    return extract_shards(cfg, Path(folder), spec, shards, target), torch.get_num_threads()


def _run_shards(cfg: StudyConfig, env: dict[str, str], plan: Any, missing: list) -> tuple[int, int | None]:
    """The missing shards of `plan` over `features.num_workers` tasks; (tokens computed, a task's threads)."""
    parts = [missing[w:: cfg.features.num_workers] for w in range(min(cfg.features.num_workers, len(missing)))]
    refs = [_target_task(cfg, env, _extract_part, str(plan.folder), plan.spec, part) for part in parts]
    try:
        results = ray.get(refs)
    except BaseException:  # no task may go on writing into the set once the driver gives up its lock
        for ref in refs:
            ray.cancel(ref, force=True)
        raise
    return sum(tokens for tokens, _ in results), results[0][1] if results else None


def extract_feature_sets(cfg: StudyConfig, env: dict[str, str], names: list[str]) -> dict[str, dict]:
    """Extract the feature sets `names`, one after the other (a later set copies the conversations it shares
    with an earlier one); the scalar stats of each by name."""
    run_shards = functools.partial(_run_shards, cfg, env)
    out = {}
    for name in names:
        features = extract_features(cfg, name, progress=False, run_shards=run_shards)
        out[name] = {k: v for k, v in features.stats.items() if isinstance(v, (int, float, str, bool))}
    return out
