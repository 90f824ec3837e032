"""`ray_runtime`: the local Ray and Serve's HTTP proxy listen on loopback only, every socket of them."""

from __future__ import annotations

import os
import socket

from taps_ray.ray_runtime import start_serve

from listeners import exposed, is_loopback, listeners


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loopback_check_accepts_only_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1", "::ffff:127.9.0.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "::ffff:0.0.0.0", "192.0.2.2", "::ffff:192.0.2.2", "fe80::1"]))


def test_ray_and_serve_listen_on_loopback_only(ray_session):
    ray = ray_session
    from ray import serve

    worker_pid = ray.get(ray.remote(lambda: os.getpid()).remote())  # a worker process exists and is counted
    port = _free_port()
    start_serve(port=port)
    try:
        found = listeners()
    finally:
        serve.shutdown()
    ports = {listener.port for listener in found}
    gcs_port = int(ray._private.worker._global_node.gcs_address.rsplit(":", 1)[1])
    assert {gcs_port, port} <= ports, f"the check must see the GCS and the Serve proxy: {sorted(ports)}"
    assert {os.getpid(), worker_pid} <= {listener.pid for listener in found}  # the driver's and a worker's gRPC servers
    assert not exposed(found), f"Ray listeners off loopback: {exposed(found)}"


def test_actor_environment_is_set_before_anything_is_imported(ray_session, monkeypatch):
    """The driver's HF/TAPS settings reach a task's process through its `runtime_env`: huggingface_hub reads
    them once, at import, and sees them."""
    from taps_ray.ray_runtime import process_runtime_env

    ray = ray_session
    monkeypatch.setenv("HF_HOME", "/nonexistent/taps-hf-home")  # runtime.ENV_KEYS, set on the driver only
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")  # the gated target's download needs it on every node

    @ray.remote
    def seen() -> tuple[str, int, str, str | None]:
        from huggingface_hub import constants, get_token

        return constants.HF_HOME, constants.HF_HUB_ETAG_TIMEOUT, os.environ["OMP_WAIT_POLICY"], get_token()

    task = seen.options(runtime_env=process_runtime_env({"HF_HUB_ETAG_TIMEOUT": "17"}))
    assert ray.get(task.remote(), timeout=120) == ("/nonexistent/taps-hf-home", 17, "PASSIVE", "hf_not_a_real_token")
