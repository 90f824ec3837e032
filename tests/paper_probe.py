"""Run inside every Ray worker process of the paper dry run (the job's `worker_process_setup_hook`): records,
each time a process resolves its device (every actor kind and the features task do so at start, before loading
anything), which actor or task it is and the Hub token it sees, so the dry run can assert the token reached
every actor kind through the project's runtime environment, not through the raylets' own environment."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

PROBE_DIR = "PAPER_PROBE_DIR"  # where each record goes (set in the job's runtime environment)
TOKEN = "HF_TOKEN"


def install() -> None:
    """Wrap `resolve_device` before any project module binds it (the hook runs before the first task)."""
    from taps_ray.models import device

    original = device.resolve_device

    def resolve_and_record(target):
        import ray

        context = ray.get_runtime_context()
        actor = context.get_actor_id()
        record = {"actor_id": actor, "task": None if actor else context.get_task_name(), "token": os.environ.get(TOKEN)}
        Path(os.environ[PROBE_DIR], f"{os.getpid()}-{uuid.uuid4().hex}.json").write_text(json.dumps(record))
        return original(target)

    device.resolve_device = resolve_and_record
