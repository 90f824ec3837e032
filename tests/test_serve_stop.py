"""`taps serve` as a process (issue 44): a bad or busy port is one line before Ray starts; the replica runs at nice
0; SIGTERM or Ctrl-C during a stream lets the stream finish with [DONE] while new requests get 503, and leaves no
process it started. The server runs in a session of its own, so "left behind" means: a process of that session,
whatever other Ray runs here."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _serve(config: Path, port: int, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "taps_ray.cli", "serve", "--config", str(config), "--port",
                             str(port)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True, **popen)


def _session_processes(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (zombies are gone already, only not yet reaped)."""
    found = []
    for process in psutil.process_iter(["pid", "name", "status", "cmdline"]):
        try:
            if os.getsid(process.pid) == sid and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def _session(sid: int) -> list[str]:
    """The live processes of session `sid`, as `pid name` lines."""
    return [f"{process.pid} {process.info['name']}" for process in _session_processes(sid)]


def _replica_niceness(sid: int) -> list[int]:
    """The nice value of each Serve replica of session `sid`."""
    return [process.nice() for process in _session_processes(sid)
            if "ServeReplica" in " ".join(process.info["cmdline"] or [])]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def study(tiny_config, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve-stop") / "study.yaml"
    path.write_text(yaml.safe_dump(tiny_config.model_dump(mode="json")))
    return path


def test_busy_or_bad_port_is_one_line_before_ray(study):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for bad, needle in ((port, f"port {port} on 127.0.0.1 is already in use"), (70000, "is not a TCP port")):
            result = _serve(study, bad, stdout=subprocess.PIPE, stderr=subprocess.PIPE).communicate(timeout=120)
            assert result[1].strip().count("\n") == 0 and needle in result[1] and "--port" in result[1], result
            assert "Ray" not in result[0] + result[1]


@pytest.mark.parametrize(("stop", "listener"), [("sigterm", "proxy"), ("ctrl-c", "proxy"), ("sigterm", "replica")])
def test_a_stop_drains_the_stream_refuses_new_requests_and_leaves_nothing(study, tmp_path, stop, listener):
    """SIGTERM to the server, or Ctrl-C: SIGINT to its whole process group, Ray's processes included; through
    Serve's proxy, or with the replica listening itself (serve.listener)."""
    port = _free_port()
    config = study
    if listener != "proxy":
        data = yaml.safe_load(study.read_text())
        data["serve"]["listener"] = listener
        config = tmp_path / "study.yaml"
        config.write_text(yaml.safe_dump(data))
    server = _serve(config, port, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for line in server.stdout:
            if line.startswith("taps serve: http"):
                break
        assert server.poll() is None, "the server did not start"
        # no Content-Type header, as `curl -d` without -H: still read as JSON
        plain = json.dumps({"model": "plain", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        first = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        first.request("POST", "/v1/completions", plain)
        assert first.getresponse().status == 200

        stream = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        stream.request("POST", "/v1/completions", json.dumps(
            {"model": "plain", "prompt": "hello", "max_tokens": 500, "temperature": 1.0, "stream": True}),
            {"Content-Type": "application/json"})
        response = stream.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        assert len(_session(server.pid)) > 3  # the driver, Ray's GCS, raylet, agents, proxy, replica
        # the replica decodes at the local Ray's `ray.worker_niceness` (0), not Ray's 15, below any client here
        assert _replica_niceness(server.pid) == [0]
        # a replica answering HTTP itself runs beside a quieter Ray background (ray_runtime.QUIET_SERVE_ENV)
        loop_intervals = {process.environ().get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S")
                          for process in _session_processes(server.pid)
                          if "ServeController" in " ".join(process.info["cmdline"] or [])}
        assert loop_intervals == ({"1.0"} if listener == "replica" else {None})
        if stop == "sigterm":
            server.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.pid, signal.SIGINT)

        statuses: list[int] = []

        def new_request() -> None:  # while the stream drains
            time.sleep(0.3)
            late = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            late.request("POST", "/v1/completions", plain, {"Content-Type": "application/json"})
            statuses.append(late.getresponse().status)

        late_thread = threading.Thread(target=new_request)
        late_thread.start()
        rest = response.read().decode()
        late_thread.join()
        events = [e for e in rest.split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length" or "error" in last
        assert statuses == [503]
        out, _ = server.communicate(timeout=120)
        assert server.returncode == 0 and "taps serve: stopped" in out
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _session(server.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session(server.pid) == []
