"""`cluster.runtime`: the local Ray and Serve's HTTP proxy listen on loopback only, every socket of them."""

from __future__ import annotations

import os
import socket

import psutil

from taps_ray.cluster.runtime import start_serve

LOOPBACKS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _session_pids(ray) -> set[int]:
    """This process (the driver) and every process of its Ray node (GCS, raylet, agents) with their children."""
    node = ray._private.worker._global_node
    roots = {os.getpid(), *(info.process.pid for infos in node.all_processes.values() for info in infos)}
    pids = set(roots)
    for pid in roots:
        try:
            pids |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return pids


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return "exited"


def _listeners(pids: set[int]) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, process name) of every listening TCP socket of these processes."""
    return [(c.laddr.ip, c.laddr.port, c.pid, _name(c.pid)) for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_and_serve_listen_on_loopback_only(ray_session):
    ray = ray_session
    from ray import serve

    worker_pid = ray.get(ray.remote(lambda: os.getpid()).remote())  # a worker process exists and is counted
    port = _free_port()
    start_serve(port=port)
    try:
        listeners = _listeners(_session_pids(ray))
    finally:
        serve.shutdown()
    ports = {p for _, p, _, _ in listeners}
    gcs_port = int(ray._private.worker._global_node.gcs_address.rsplit(":", 1)[1])
    assert {gcs_port, port} <= ports, f"the check must see the GCS and the Serve proxy: {sorted(ports)}"
    assert {os.getpid(), worker_pid} <= {pid for _, _, pid, _ in listeners}  # the driver's and a worker's gRPC servers
    exposed = [(ip, p, name) for ip, p, _, name in listeners if ip not in LOOPBACKS]
    assert not exposed, f"Ray listeners off loopback: {exposed}"


def test_actor_environment_is_set_before_anything_is_imported(ray_session, monkeypatch):
    """The driver's HF/TAPS settings reach a task's process through its `runtime_env`: huggingface_hub reads
    them once, at import, and sees them."""
    from taps_ray.cluster.runtime import process_runtime_env

    ray = ray_session
    monkeypatch.setenv("HF_HOME", "/nonexistent/taps-hf-home")  # runtime.ENV_KEYS, set on the driver only
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")  # the gated target's download needs it on every node

    @ray.remote
    def seen() -> tuple[str, int, str, str | None]:
        from huggingface_hub import constants, get_token

        return constants.HF_HOME, constants.HF_HUB_ETAG_TIMEOUT, os.environ["OMP_WAIT_POLICY"], get_token()

    task = seen.options(runtime_env=process_runtime_env({"HF_HUB_ETAG_TIMEOUT": "17"}))
    assert ray.get(task.remote(), timeout=120) == ("/nonexistent/taps-hf-home", 17, "PASSIVE", "hf_not_a_real_token")
