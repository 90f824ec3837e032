"""The quick sweep on a real multi-node Ray cluster (all on loopback), losing a node mid-evaluation.

Three nodes join the session's cluster (`ray_cluster`, a 2-CPU head that drives and runs the features task
and Tune trials): one advertises what a GPU node of a given type does (`accelerator_type:H200`), and the target
workers ask for a sliver of it, as `ray.target_resources` pins them on a real cluster; two CPU nodes hold the
drafter actors (`drafter_slot`). Once some cells are finished, the node of the drafter that was just handed a
cell is removed: its drafter is restarted on the other CPU node, the lost cell is retried, and the sweep ends
with every cell stored exactly once, finished cells untouched.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from taps_ray.config import StudyConfig
from taps_ray.eval.commands import plan_cells
from taps_ray.eval.cell import Cell
from taps_ray.eval.store import ResultsStore

ACCELERATOR = "accelerator_type:H200"  # the resource Ray itself advertises on a node with H200 GPUs
DRAFTER_SLOT = "drafter_slot"


def _study(tiny_config: StudyConfig, work: Path) -> StudyConfig:
    """The tiny study, shrunk further: the quick sweep of it runs in about a minute here."""
    evaluation = tiny_config.eval.model_copy(
        update={"benchmarks": {"gsm8k": 1, "mt_bench": 1}, "temperatures": [0.0, 1.0], "proposers": ["math", "merged"]}
    )
    train = tiny_config.train.model_copy(update={"kinds": ["eagle2"], "mixtures": ["math", "chat"]})
    ray_cfg = tiny_config.ray.model_copy(
        update={
            "num_target_workers": 1,
            "num_drafters": 2,
            "target_num_cpus": 0.1,
            "drafter_num_cpus": 0.1,
            "trial_cpus": 0.5,
            "torch_threads": 1,
            "target_resources": {ACCELERATOR: 0.01},
            "drafter_resources": {DRAFTER_SLOT: 1},
            "max_cell_retries": 2,
            "actor_max_restarts": 4,
        }
    )
    mixtures = {name: m.model_copy(update={"size": 16}) for name, m in tiny_config.mixtures.items()}
    return tiny_config.model_copy(
        update={"eval": evaluation, "train": train, "ray": ray_cfg, "mixtures": mixtures, "work_dir": str(work),
                "reports_dir": str(work / "reports")}
    )


def _node_of(ray_cluster, actor, timeout: float = 120.0) -> str:
    """The id of the node that hosts `actor` once it is alive (it may still be starting, or restarting
    elsewhere after its node died; just created, the GCS may not list it yet: an empty entry)."""
    deadline = time.monotonic() + timeout
    while True:
        info = ray_cluster.global_state.actor_table(actor._actor_id.hex())
        if info.get("State") == "ALIVE":
            return info["Address"]["NodeID"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor {actor} not alive after {timeout:.0f} s: {info}")
        time.sleep(0.2)


def test_quick_sweep_survives_losing_a_node_mid_evaluation(ray_cluster, ray_session, tiny_config, tmp_path):
    from taps_ray.study.run_config import quick_config
    from taps_ray.study.sweep import run_sweep

    ray = ray_session
    gpu_node = ray_cluster.add_node(num_cpus=1, resources={ACCELERATOR: 1.0}, node_ip_address="127.0.0.1")
    cpu_nodes = [ray_cluster.add_node(num_cpus=1, resources={DRAFTER_SLOT: 2.0}, node_ip_address="127.0.0.1") for _ in range(2)]
    added = [gpu_node, *cpu_nodes]
    try:
        ray_cluster.wait_for_nodes()
        assert len([n for n in ray.nodes() if n["Alive"]]) == 4
        cfg = _study(tiny_config, tmp_path / "work")
        cells = plan_cells(quick_config(cfg))
        assert len(cells) == 12  # plain + math + merged, 2 benchmarks x 2 temperatures

        submitted: list[tuple[str, int, str]] = []  # (cell, attempt, node it was sent to)
        finished: list[str] = []
        removed: dict[str, object] = {}
        done_at: dict[str, float] = {}
        store = ResultsStore(Path(quick_config(cfg).work_dir).resolve() / "results")

        def on_submit(cell: Cell, attempt: int, drafter) -> None:
            node_id = _node_of(ray_cluster, drafter)
            submitted.append((cell.id, attempt, node_id))
            node = next((n for n in cpu_nodes if n.node_id == node_id), None)
            if node is not None and len(finished) >= 2 and not removed:  # this cell is in flight on `node`
                removed.update(node=node, finished=list(finished))
                ray_cluster.remove_node(node, allow_graceful=False)

        def on_cell_done(cell: Cell) -> None:
            finished.append(cell.id)
            done_at[cell.id] = (store.cell_dir(cell) / "done.json").stat().st_mtime_ns

        result = run_sweep(cfg, quick=True, stages=["data", "features", "train", "eval"], on_submit=on_submit,
                           on_cell_done=on_cell_done, log=lambda _: None)
    finally:
        for node in added:
            if node in ray_cluster.worker_nodes:
                ray_cluster.remove_node(node)

    assert removed, "no node was removed: the evaluation ended before a drafter node could be taken away"
    evaluation = result["stages"]["eval"]
    assert evaluation["failed"] == [] and evaluation["retries"] >= 1
    assert sorted(evaluation["done"]) == sorted(c.id for c in cells)
    assert sorted(finished) == sorted(c.id for c in cells)  # every cell finished exactly once: nothing redone
    assert all(store.is_done(c) for c in cells)
    for cell in cells:  # the finished cells were never written again
        meta = json.loads((store.cell_dir(cell) / "done.json").read_text())
        assert (store.cell_dir(cell) / "done.json").stat().st_mtime_ns == done_at[cell.id]
        if cell.id in removed["finished"]:
            assert meta["attempts"] == 1
    retried = {cid for cid, attempt, _ in submitted if attempt >= 1}  # the cells in flight on the lost node
    assert retried and not retried & set(removed["finished"])
    by_id = {c.id: c for c in cells}
    assert all(json.loads((store.cell_dir(by_id[c]) / "done.json").read_text())["attempts"] >= 2 for c in retried)
    assert {node for _, _, node in submitted} <= {n.node_id for n in cpu_nodes}  # drafters only where drafter slots are
    survivor = next(n for n in cpu_nodes if n is not removed["node"])
    assert submitted[-1][2] == survivor.node_id  # the lost drafters came back on the CPU node left
    trained = result["stages"]["train"]
    assert sorted(trained["trained"]) == ["eagle2-chat", "eagle2-math"] and not trained["failed"]


@pytest.fixture(autouse=True)
def _only_the_head_is_left(ray_cluster):
    """Every other test sees the session's cluster as it was: the head alone."""
    yield
    assert not ray_cluster.worker_nodes
