"""The node types of a Ray cluster config (`ray up` YAML), read for `taps plan --cluster`.

Checked as Ray's own schema checks it (`ray up` refuses unknown keys at the top level and in a node type; a
node type needs `resources` and `node_config`), so a misspelt `resorces` is an error naming the key, not a node
with no resources that "does not fit". Every problem is one line (`ClusterFileError`) naming the file, the key
and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, ValidationError

from taps_ray.config import read_yaml_mapping
from taps_ray.spelling import did_you_mean


class ClusterFileError(ValueError):
    """A cluster config that cannot be read; the message names the file, the key and what to change."""


class NodeTypeSpec(BaseModel):
    """One entry of `available_node_types` (Ray's schema: these keys and no others)."""

    model_config = ConfigDict(extra="forbid")

    resources: dict[str, NonNegativeFloat]
    node_config: dict[str, Any]
    min_workers: int = 0
    max_workers: int | None = None
    idle_timeout_s: float | None = None
    priority: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    initialization_commands: list[str] = Field(default_factory=list)
    worker_setup_commands: list[str] = Field(default_factory=list)
    docker: dict[str, Any] = Field(default_factory=dict)


class ClusterSpec(BaseModel):
    """A Ray cluster config: the keys Ray's schema allows, with the node types the plan reads."""

    model_config = ConfigDict(extra="forbid")

    cluster_name: str
    provider: dict[str, Any]
    available_node_types: dict[str, NodeTypeSpec] = Field(min_length=1)
    max_workers: int | None = None
    upscaling_speed: float | None = None
    idle_timeout_minutes: float | None = None
    auth: dict[str, Any] | None = None
    docker: dict[str, Any] | None = None
    head_node_type: str | None = None
    file_mounts: dict[str, Any] | None = None
    cluster_synced_files: list[Any] | None = None
    file_mounts_sync_continuously: bool | None = None
    rsync_exclude: list[str] | None = None
    rsync_filter: list[str] | None = None
    metadata: dict[str, Any] | None = None
    initialization_commands: list[str] | None = None
    setup_commands: list[str] | None = None
    head_setup_commands: list[str] | None = None
    worker_setup_commands: list[str] | None = None
    head_start_ray_commands: list[str] | None = None
    worker_start_ray_commands: list[str] | None = None
    no_restart: bool | None = None


def read_cluster(path: str | Path) -> ClusterSpec:
    """The validated cluster config at `path`, or a `ClusterFileError` naming its first problem."""
    path = Path(path)
    data = read_yaml_mapping(path, "cluster file", ClusterFileError, "pass a Ray cluster config such as cluster.yaml",
                             "Ray cluster keys; see cluster.yaml")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as error:
        raise ClusterFileError(f"cluster file {path}: {_first_problem(error)}; see cluster.yaml") from None


def _first_problem(error: ValidationError) -> str:
    """The first problem, a misspelt key before anything else (it also makes the right key look missing)."""
    item = min(error.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc = [str(p) for p in item["loc"]]
    where = ".".join(loc)
    if item["type"] == "extra_forbidden":
        model = NodeTypeSpec if loc[0] == "available_node_types" else ClusterSpec
        return f"{where} is not a key Ray knows{did_you_mean(loc[-1], model.model_fields)}"
    if item["type"] == "missing":
        return f"{where} is missing"
    return f"{where}: {item['msg'].removeprefix('Value error, ')} (got {item.get('input')!r})"
