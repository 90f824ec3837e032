"""The one way this project starts or joins Ray, and what every Ray process it starts must see.

* `start_ray`: joins a cluster when an address is given (argument, `ray.address`, or RAY_ADDRESS as under
  `ray job submit`); otherwise starts a new single-machine Ray whose every listener (GCS, raylet, agents, workers,
  the driver's own) is bound to 127.0.0.1, with no dashboard, and whose workers run at `ray.worker_niceness`
  (0: Ray's default 15 put a Serve replica below the benchmark client that measured it, which then preempted
  its decode; 35-45 against 59 tok/s under vLLM's client at 16 in flight, 2-core Intel Xeon, fp32).
* `start_serve`: Ray Serve's HTTP proxy, on 127.0.0.1 unless a host is configured.
* `bind_replica_grpc_to_node`: a Serve replica's own gRPC server on its node's address (127.0.0.1 in a local
  Ray), not on every interface.
* `runtime_env_vars`, `process_runtime_env`: the driver's environment and OpenMP behaviour, handed to each actor
  or task as its Ray `runtime_env`, so they are set when its process starts, before anything is imported.
* `prepare_process`: the torch thread count of an actor or task process.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from taps_ray.config import DATA_DIR_ENV, RayConfig

LOOPBACK = "127.0.0.1"
# "0" puts Ray in its single-machine mode: it takes 127.0.0.1 as the node address and binds every gRPC server
# there; `_node_ip_address` alone leaves the GCS, raylet and worker ports on 0.0.0.0.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Where Ray Serve 2.60 binds each replica's inter-deployment gRPC server: every interface, any port.
REPLICA_GRPC_ANY_ADDRESS = "[::]:0"
# Ray starts its workers at this nice value (15 unless set): below every ordinary process on the machine
WORKER_NICENESS_ENV = "RAY_worker_niceness"
# A local Ray of one user needs no token and reports nothing home; set unless the caller chose otherwise.
LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# A local Ray behind one replica that answers HTTP itself (`taps serve` with serve.listener: replica): Serve's
# controller loop and the raylet's resource reports every second instead of every 0.1 s, and autoscaling metrics
# every 30 s (one replica never autoscales). Why: on a CPU replica every wakeup of Ray's background displaces one
# of the decode threads, and a team of OpenMP threads waits for its slowest (docs/serve.md, "Threads").
QUIET_SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "30",
}

# What a remote process must see as the driver does (offline switches, local data, caches, the Hub token:
# the paper's Llama-3-8B-Instruct is gated, and a GPU task without the driver's HF_TOKEN fails to download it;
# under `ray job submit --runtime-env-json '{"env_vars": {"HF_TOKEN": ...}}'` the driver has it, and hands it on
# here; HF_HOME on the shared disk (cluster.yaml) downloads it once for every node).
ENV_KEYS = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "HF_HOME",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",  # the older name, still read by huggingface_hub
    DATA_DIR_ENV,
    "TAPS_CACHE",
    "TOKENIZERS_PARALLELISM",
)


def start_ray(cfg: RayConfig, address: str | None = None, *, log_to_driver: bool = True,
              local_env: dict[str, str] | None = None) -> bool:
    """Join or start Ray (see the module docstring); returns False when Ray was already initialised.
    `local_env`: variables a local Ray's processes start with, unless already set (ignored when joining a cluster).

    A True return means this call started the connection, and its caller owns `ray.shutdown()`.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or cfg.address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by a local Ray's workers (Tune trials too)
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return True
    _loopback_only()
    # the raylet reads it when this call starts it, and starts every worker at that nice value (Ray: 15)
    os.environ.setdefault(WORKER_NICENESS_ENV, str(cfg.worker_niceness))
    for key, value in (local_env or {}).items():
        os.environ.setdefault(key, value)
    # "local": a new instance even when another Ray runs on this machine (None would join that one)
    ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK,
             log_to_driver=log_to_driver)
    return True


def _loopback_only() -> None:
    """Put this process, and every Ray process it starts, in Ray's single-machine loopback mode."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault(LOOPBACK_ENV, "0")
    if os.environ[LOOPBACK_ENV] == "0":
        from ray._private import ray_constants  # read when ray was first imported: it may predate the line above

        ray_constants.ENABLE_RAY_CLUSTER = False


def loopback_cluster(num_cpus: int, object_store_memory: int | None = None, runtime_env: dict | None = None) -> Any:
    """A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), every listener on 127.0.0.1,
    with this process connected as its driver. Nodes added with `add_node(node_ip_address=LOOPBACK, ...)` have
    their own resources, so placement, node loss and retries are tested without any other address.
    `runtime_env`: the job's, as `ray job submit --runtime-env-json` would give it."""
    import ray
    from ray.cluster_utils import Cluster

    _loopback_only()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": num_cpus, "node_ip_address": LOOPBACK, "include_dashboard": False,
                        "object_store_memory": object_store_memory},
    )
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env)
    return cluster


def start_serve(host: str = LOOPBACK, port: int = 8000, proxy: bool = True) -> None:
    """Start Ray Serve (Ray must be initialised) with its HTTP proxy on host:port, or with no proxy (`proxy`
    False: the deployment answers HTTP itself, `serve.listener: replica`)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, proxy_location=None if proxy else "Disabled")


def bind_replica_grpc_to_node() -> None:
    """Make this Serve replica bind its inter-deployment gRPC server to the address Ray gives its node
    (127.0.0.1 in a local, loopback Ray) instead of `[::]` (every interface); the deployment's constructor calls it.

    Why: Ray Serve 2.60 starts that server in every replica right after the deployment's constructor returns, at
    `[::]:0`, whatever the configuration: there is no switch to leave it off and no host setting
    (`RAY_SERVE_USE_GRPC_BY_DEFAULT` only decides whether handles send requests through it; by default they use
    Ray actor calls). Its routers dial it at `<replica node address>:<port>`, so the node's address is all it needs,
    on one machine and on a cluster alike. Ray's replica module looks the port helper up when it starts the
    server, so replacing it there before then is enough.
    """
    import ray
    from ray.serve._private import replica

    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None:
        raise RuntimeError(f"ray {ray.__version__}: ray.serve._private.replica has no add_port_to_grpc_server, so "
                           "the replica's gRPC server cannot be kept off other interfaces; pin ray to the version "
                           f"in constraints.txt or update {__name__}.bind_replica_grpc_to_node for this one")
    if getattr(add_port, "binds_to_node", False):
        return

    def add_port_on_node(server: Any, address: str) -> int:
        if address == REPLICA_GRPC_ANY_ADDRESS:
            host = ray.util.get_node_ip_address()
            address = f"[{host}]:0" if ":" in host else f"{host}:0"
        return add_port(server, address)

    add_port_on_node.binds_to_node = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_on_node


def runtime_env_vars() -> dict[str, str]:
    """The driver's values of `ENV_KEYS`, to hand to an actor or task."""
    return {key: os.environ[key] for key in ENV_KEYS if key in os.environ}


def process_runtime_env(env: dict[str, str] | None = None) -> dict:
    """The `runtime_env` of every actor and task this project starts: its variables are set when the process
    starts, before torch or transformers are imported (they read the HF offline switches at import). It holds
    the driver's `ENV_KEYS` (`runtime_env_vars`), then `env` on top, and OpenMP threads that sleep instead of
    spinning while they wait: a drafter and its target worker take turns on the same cores; spinning idle
    threads of one would steal them from the other (on the shared 2-core CPU that cost 2.5-3x, see
    taps_ray/training)."""
    defaults = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "TOKENIZERS_PARALLELISM": "false"}
    return {"env_vars": {**defaults, **runtime_env_vars(), **(env or {})}}


OMP_WAIT_ENV = {  # serve.replica_omp_wait: libgomp reads these once, when the process loads it
    "default": {"GOMP_SPINCOUNT": "300000"},  # libgomp's default spin (~3 ms) whatever OMP_WAIT_POLICY says
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}


def prepare_process(threads: int | None, num_cpus: float) -> int:
    """Pin torch's thread count (Ray sets OMP_NUM_THREADS to the CPUs): `threads`, else the CPUs reserved."""
    n = threads or max(1, math.ceil(num_cpus))
    torch.set_num_threads(n)
    return n
