"""`taps plan` (taps_ray/plan.py): exact parameter counts from a config on the meta device, the paper setting
fitting cluster.yaml's node types, "does not fit" with the fix, and docs/paper_plan.md as its output."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from taps_ray import plan
from taps_ray.config import load_config

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper.yaml"
CLUSTER = REPO / "cluster.yaml"


def _args(**over) -> argparse.Namespace:
    return argparse.Namespace(**{"config": "configs/paper.yaml", "cluster": "cluster.yaml", "model_config": None,
                                 "doc": None, **over})


def test_llama_3_8b_parameters_are_exact_on_the_meta_device():
    cfg = load_config(PAPER)
    s = plan.shapes(plan.model_config(cfg), cfg.train.kinds)
    assert s.total == 8_030_261_248 and s.embed == s.lm_head == 128_256 * 4_096  # Llama-3-8B's published count
    assert s.head == {"eagle2": 251_662_336, "hass": 251_662_336}  # fc without a bias, as vLLM reads it
    assert s.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_meta_count_equals_the_built_model(tiny_config, tiny_target):
    s = plan.shapes(plan.model_config(tiny_config), ["eagle2"])
    assert s.total == sum(p.numel() for p in tiny_target.model.parameters())


def test_every_actor_of_the_paper_setting_fits_cluster_yaml():
    text, ok = plan.build(_args())
    assert ok, text
    cfg = load_config(PAPER)
    verdicts = plan.verdicts(cfg, plan.shapes(plan.model_config(cfg), cfg.train.kinds), plan.node_types(CLUSTER))
    for v in verdicts:  # each kind lands on at least one node type, and fits every node type Ray may pick
        placeable = [f for f in v.fits if f.placeable]
        assert placeable and all(f.fits for f in placeable), (v.kind, v.fits)
        assert v.request.memory is not None and v.request.memory >= v.need.host_bytes, v.kind


def test_an_actor_that_does_not_fit_is_named_with_its_fix(tmp_path):
    cluster = yaml.safe_load(CLUSTER.read_text())
    cluster["available_node_types"]["gpu_a10g"] = {  # the 24 GB node type cluster.yaml used to have
        "resources": {"CPU": 8, "GPU": 1, "memory": 22_000_000_000, "accelerator_type:A10G": 1},
        "node_config": {"InstanceType": "g5.2xlarge"}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    config = yaml.safe_load(PAPER.read_text())
    config["ray"]["trial_resources"] = {}  # trials unpinned: Ray may put one on the A10G
    config["serve"].pop("replica_num_gpus")  # the replica asks for no GPU
    (tmp_path / "paper.yaml").write_text(yaml.safe_dump(config))
    text, ok = plan.build(_args(config=str(tmp_path / "paper.yaml"), cluster=str(tmp_path / "cluster.yaml")))
    assert not ok and "DOES NOT FIT" in text
    assert "does not fit gpu_a10g" in text and 'pin it with ray.trial_resources: {"accelerator_type:' in text
    assert "asks for no GPU, so it runs the target on the CPU: set serve.replica_num_gpus" in text


def test_docs_paper_plan_is_the_plan_output():
    text, _ = plan.build(_args())
    doc = (REPO / "docs" / "paper_plan.md").read_text()
    block = doc.split(plan.BEGIN, 1)[1].split(plan.END, 1)[0].strip()
    assert block == text.strip(), "docs/paper_plan.md is stale: rerun the command it names"


def test_every_bundle_holds_all_its_actor_asks_for():
    """A placement-group bundle without the actor's `memory` makes Ray reject the actor ("cannot fit into any
    bundles") when evaluation starts; the dry run shows it on a cluster, this shows it in a millisecond."""
    from taps_ray import ray_requests

    cfg = load_config(PAPER)
    for kind in ray_requests.KINDS:
        request = ray_requests.request_of(cfg, kind)
        options = request.options()
        wanted = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], "memory": options.get("memory", 0),
                  **options["resources"]}
        assert request.bundle() == {k: v for k, v in wanted.items() if v}, kind
        assert request.bundle()["memory"] == options["memory"] > 0, kind
