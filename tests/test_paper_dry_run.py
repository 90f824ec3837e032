"""The paper setting at first contact, on a loopback cluster: `configs/paper.yaml` itself, read from disk, with
only the model, the data sizes and the device swapped for the tiny ones, through features -> train -> eval ->
report -> a Serve replica that answers one request.

The cluster is shaped as `cluster.yaml`'s node types: a head with no CPU (the driver only), a p4d.24xlarge-like
node (8 GPUs, its memory, `accelerator_type:A100`) and two g6e.2xlarge-like nodes (1 GPU, `accelerator_type:L40S`),
every node advertising exactly the GPUs, memory and accelerator resource cluster.yaml declares; CPU counts, of
the nodes and of every actor alike, are divided by `CPU_SCALE` so that the shapes fit two real cores. The ray:
section (placement groups of 1 worker + 4 drafters at 0.25 GPU, memory per actor, accelerator pins), the Tune
storage layout (`<work_dir>/tune`) and the serve options (2 replicas of 1 GPU and 24 GB each) are paper.yaml's;
only the number of evaluation groups is cut to one of its four, and Serve listens on loopback.

Ray's own records are then compared with `taps plan`'s resource requests (`taps_ray.plan`): the bundles of the
evaluation's placement group, of each Tune trial, and the requests of the actors, the features task and the Serve
replicas. The run happens in a subprocess (this file run as a script), which owns the cluster: the test session's
own cluster (`ray_cluster`) has a head with CPUs, and one process holds one Ray connection.

The Hub token: a fake `HF_TOKEN` reaches the driver after the nodes started (as `ray job submit --runtime-env-json`
gives it to the driver only), and every actor kind and the features task must see it from inside
(`paper_probe`, the job's worker setup hook, records what each one sees when it resolves its device).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

import paper_probe

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper.yaml"
TINY = REPO / "configs" / "tiny.yaml"
CLUSTER = REPO / "cluster.yaml"
CPU_SCALE = 8  # node and actor CPU counts divided by this: a p4d's 96 CPUs become 12, a trial's 8 become 1
OBJECT_STORE = 80 * 1024**2  # per node: the machine is shared
SIZE = 16  # conversations per single-domain mixture (the mixed ones keep paper.yaml's ratio to them)
# actor class name (prefix) in Ray's actor table -> actor kind of the plan; Tune runs a function trainable as
# `ImplicitFunc` actors
ACTOR_CLASSES = {"TargetWorker": "target_worker", "DrafterActor": "drafter", "ImplicitFunc": "tune_trial",
                 "ServeReplica:": "serve_replica"}
FEATURES_TASK = "_run_on_target"  # the features task's function (taps_ray/study/target_tasks.py)
DRY_TOKEN = "hf_dryrun_not_a_real_token"  # what `ray job submit --runtime-env-json` would give the driver
PG_MARKER = "bundle"  # the token resource Ray adds to every request made inside a placement group


def paper_dry_config(work: Path) -> dict:
    """paper.yaml as loaded from disk, with the tiny model, data sizes and CPU device; all else unchanged."""
    paper = yaml.safe_load(PAPER.read_text())
    tiny = yaml.safe_load(TINY.read_text())
    cfg = dict(paper)
    cfg["target"] = {**tiny["target"], "device": "cpu"}
    smallest = min(m["size"] for m in paper["mixtures"].values())
    cfg["mixtures"] = {name: {**m, "size": m["size"] * SIZE // smallest} for name, m in paper["mixtures"].items()}
    cfg["features"] = {**paper["features"], "max_len": tiny["features"]["max_len"]}
    cfg["train"] = {**paper["train"], "kinds": ["eagle2"], "epochs": 1, "max_tokens": 1500,
                    "precision": "fp32", "batch_size": tiny["train"]["batch_size"]}
    cfg["tree"] = tiny["tree"]
    proposers = ["math", "merged"]
    benchmarks = {name: 1 for name in paper["eval"]["benchmarks"] if name in ("mt_bench", "gsm8k")}  # 2 turns, 1
    cfg["eval"] = {**paper["eval"], "benchmarks": benchmarks,
                   "max_new_tokens": 12, "proposers": proposers, "batch_size": 2}
    ray_section = dict(paper["ray"])
    for key in ("target_num_cpus", "drafter_num_cpus", "trial_cpus"):
        ray_section[key] = ray_section.get(key, 1.0) / CPU_SCALE
    per_group = ray_section["num_drafters"] // ray_section["num_target_workers"]
    ray_section.update(num_target_workers=1, num_drafters=per_group, torch_threads=1)
    cfg["ray"] = ray_section
    cfg["serve"] = {**paper["serve"], "host": "127.0.0.1", "replica_num_cpus": paper["serve"]["replica_num_cpus"] / CPU_SCALE,
                    "max_prompt_tokens": 256, "max_tokens_limit": 16, "default_max_tokens": 8}
    cfg["work_dir"] = str(work)
    cfg["reports_dir"] = str(work / "reports")
    return cfg


def cluster_nodes() -> dict[str, dict]:
    """cluster.yaml's worker node types as `Cluster.add_node` arguments (CPUs scaled, the rest as declared)."""
    config = yaml.safe_load(CLUSTER.read_text())
    nodes = {}
    for name, node_type in config["available_node_types"].items():
        if name == config["head_node_type"]:
            assert node_type["resources"] == {"CPU": 0}
            continue
        resources = dict(node_type["resources"])
        nodes[name] = {
            "num_cpus": int(resources.pop("CPU") // CPU_SCALE),
            "num_gpus": resources.pop("GPU"),
            "memory": resources.pop("memory"),
            "resources": resources,
        }
    return nodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unpinned(required: dict[str, float]) -> dict[str, float]:
    """An actor's request as its user wrote it: Ray rewrites the request of an actor in a placement group as
    `<name>_group_<bundle>_<group id>` (and a `<name>_group_<group id>` twin)."""
    plain = {}
    for name, amount in required.items():
        if name == PG_MARKER:
            continue
        if "_group_" not in name:
            plain[name] = amount
            continue
        base, rest = name.split("_group_", 1)
        if "_" in rest and base != PG_MARKER:  # the bundle-indexed twin
            plain[base] = amount
    return plain


def _actor_requests() -> list[tuple[str, dict[str, float], str]]:
    """(class name, requested resources, actor id) of every actor the GCS knows, dead ones included."""
    import ray
    from ray.core.generated import gcs_pb2

    accessor = ray._private.state.state._connect_and_get_accessor()
    out = []
    for raw in accessor.get_actor_table(None, None):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        out.append((actor.class_name, _unpinned(dict(actor.required_resources)), actor.actor_id.hex()))
    return out


def _placement_groups() -> list[list[dict[str, float]]]:
    import ray

    return [[dict(b) for b in group["bundles"].values()] for group in ray.util.placement_group_table().values()]


def run_dry_run(work: Path) -> dict:
    """The dry run itself (in this script's process): what happened and what Ray recorded, as JSON."""
    import httpx
    import ray
    from ray import serve

    from taps_ray.ray_runtime import LOOPBACK, loopback_cluster
    from taps_ray.serve.app import build_app
    from taps_ray.study.sweep import run_sweep
    from taps_ray.config import parse_config
    from taps_ray.plan import resource_requests

    cfg = parse_config(paper_dry_config(work), "paper.yaml (tiny model and sizes)")
    probes = work / "probes"
    probes.mkdir(parents=True)
    job_env = {"env_vars": {paper_probe.PROBE_DIR: str(probes)}, "worker_process_setup_hook": "paper_probe.install"}
    cluster = loopback_cluster(num_cpus=0, object_store_memory=OBJECT_STORE, runtime_env=job_env)
    observed: dict = {"groups_during_eval": []}
    try:
        nodes = cluster_nodes()
        counts = {"gpu_a100x8": 1, "gpu_l40s": 2}
        for name, args in nodes.items():
            for _ in range(counts[name]):
                cluster.add_node(**args, node_ip_address=LOOPBACK, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        # the token reaches the driver only now, as `ray job submit --runtime-env-json` sets it for the driver:
        # the raylets (and so the workers' inherited environment) never had it, only the project can hand it on
        os.environ[paper_probe.TOKEN] = DRY_TOKEN
        observed["nodes"] = [{k: v for k, v in n["Resources"].items() if not k.startswith(("node:", "object_store"))}
                             for n in ray.nodes() if n["Alive"]]

        def on_submit(*_args) -> None:
            if not observed["groups_during_eval"]:
                observed["groups_during_eval"] = _placement_groups()

        start = time.perf_counter()
        result = run_sweep(cfg, log=lambda line: print(line, flush=True), on_submit=on_submit)
        observed["sweep_s"] = round(time.perf_counter() - start, 1)
        observed["sweep"] = result
        observed["groups_after"] = _placement_groups()

        start = time.perf_counter()
        port = _free_port()
        serve.start(http_options={"host": cfg.serve.host, "port": port}, proxy_location="HeadOnly")
        serve.run(build_app(cfg), name="paper-dry-run", route_prefix="/")
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120.0, json={
            "model": "math", "max_tokens": 6, "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is 2+2?"}]})
        observed["serve"] = {"status": response.status_code, "body": response.json()}
        observed["serve_s"] = round(time.perf_counter() - start, 1)
        observed["actors"] = _actor_requests()
        observed["probes"] = [json.loads(p.read_text()) for p in probes.iterdir()]
        observed["plan"] = {kind: request.bundle() for kind, request in resource_requests(cfg).items()}
        observed["plan_options"] = {kind: request.options() for kind, request in resource_requests(cfg).items()}
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return observed


def test_paper_config_runs_features_to_serving_on_a_cluster_shaped_as_cluster_yaml(tmp_path):
    out = tmp_path / "observed.json"
    path = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]  # tests/: the probe the workers import
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "work"), str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the dry run failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}"
    seen = json.loads(out.read_text())
    print(f"dry run: {time.perf_counter() - start:.0f} s in all, sweep {seen['sweep_s']} s, serve {seen['serve_s']} s")

    plan = seen["plan"]
    stages = seen["sweep"]["stages"]
    # the nodes advertise cluster.yaml's shapes: a head with no CPU, GPUs, memory and accelerator types as declared
    shapes = sorted(json.dumps(n, sort_keys=True) for n in seen["nodes"])
    assert sum("GPU" not in json.loads(s) for s in shapes) == 1 and all(json.loads(s).get("CPU", 0) == 0
                                                                         for s in shapes if "GPU" not in json.loads(s))
    # features: the single-domain sets computed, the mixed ones copied from them without a task
    features = stages["features"]
    assert sorted(features["extracted"]) == sorted(seen["sweep"]["stages"]["data"]["mixtures"])
    for name, stats in features["stats"].items():
        if name.startswith("mixed"):
            assert stats["computed_tokens"] == 0 and stats["copied_conversations"] == stats["conversations"] > 0, name
        else:
            assert stats["computed_tokens"] > 0, name
    # training: every head of paper.yaml's mixtures, each trial in a bundle of exactly the plan's request
    train = stages["train"]
    assert not train["failed"] and len(train["trained"]) == len(stages["data"]["mixtures"])
    assert "/tune/train-paper-" in train["experiment"]  # paper.yaml's Tune storage layout: <work_dir>/tune/<experiment>
    trial_groups = [g for g in seen["groups_after"] if g == [plan["tune_trial"]]]
    assert len(trial_groups) == len(train["trained"]), seen["groups_after"]
    # evaluation: the placement group of a worker and its 4 drafters holds exactly their requests, memory included
    group = [plan["target_worker"], *[plan["drafter"]] * 4]
    assert group in seen["groups_during_eval"], seen["groups_during_eval"]
    evaluation = stages["eval"]
    assert evaluation["failed"] == [] and len(evaluation["done"]) == evaluation["cells"] > 0
    assert Path(stages["report"]["path"]).is_file()
    # the actors asked Ray for what the plan says
    wanted = {kind: plan[kind] for kind in ("target_worker", "drafter", "tune_trial", "serve_replica")}
    by_kind: dict[str, list[dict]] = {}
    for class_name, required, _ in seen["actors"]:
        kind = next((k for prefix, k in ACTOR_CLASSES.items() if class_name.startswith(prefix)), None)
        if kind is not None:
            by_kind.setdefault(kind, []).append(required)
    for kind, request in wanted.items():
        assert by_kind.get(kind) and all(r == request for r in by_kind[kind]), (kind, by_kind.get(kind), request)
    assert len(by_kind["serve_replica"]) == yaml.safe_load(PAPER.read_text())["serve"]["num_replicas"]
    # the job's Hub token, given to the driver only, was visible inside every actor kind and the features task
    kind_of = {actor_id: next((k for prefix, k in ACTOR_CLASSES.items() if name.startswith(prefix)), name)
               for name, _, actor_id in seen["actors"]}
    tokens: dict[str, set] = {}
    for probe in seen["probes"]:
        kind = kind_of.get(probe["actor_id"], probe["actor_id"]) if probe["actor_id"] else probe["task"]
        tokens.setdefault(kind, set()).add(probe["token"])
    assert {*wanted, FEATURES_TASK} <= set(tokens), tokens
    assert all(seen_tokens == {DRY_TOKEN} for seen_tokens in tokens.values()), tokens
    # a replica answered
    assert seen["serve"]["status"] == 200, seen["serve"]
    assert seen["serve"]["body"]["usage"]["completion_tokens"] > 0


if __name__ == "__main__":
    observed = run_dry_run(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(observed, default=str))
