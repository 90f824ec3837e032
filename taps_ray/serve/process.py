"""`taps serve` as a process: check the address, start Ray and the app, run until SIGINT or SIGTERM, then drain and
stop everything it started.

Why a module of its own: without handlers a SIGTERM killed the driver at once, so Serve never drained (a stream
was cut with no final chunk and no [DONE]) and the Ray agents it had started were left running; and a busy port
surfaced as a hundred lines of Ray traceback after the model had loaded. Here both signals set one event; the
main thread then shuts Serve down (each replica drains its in-flight requests, then fails what is left with a
503 that a stream reports as an error chunk and [DONE], serve/app.py `TapsService.__del__`), and then the Ray
it started.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from taps_ray.config import StudyConfig
from taps_ray.ray_runtime import QUIET_SERVE_ENV, start_ray
from taps_ray.serve.app import APP_NAME, DEPLOYMENT, start

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DRAIN_TIMEOUT_S = 30.0  # how long running requests may still finish once a stop is asked for


class ServeAddressError(ValueError):
    """`taps serve` cannot listen where it was asked to; the message names the address and the fix."""


def check_address(host: str, port: int) -> None:
    """Fail in one line, before Ray starts, when `host:port` cannot be listened on (not a port, not an address
    of this machine, or taken). SO_REUSEADDR as the HTTP server sets it: a port in TIME_WAIT is free to reuse."""
    if not 0 < port < 65536:
        raise ServeAddressError(f"port {port} is not a TCP port; give --port a number in 1-65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        raise ServeAddressError(f"host {host!r} is not an address; give --host an IP such as 127.0.0.1") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ServeAddressError(f"port {port} on {host} is already in use; choose another --port or stop "
                                        "what listens there") from None
            raise ServeAddressError(f"cannot listen on {host}:{port} ({error.strerror}); choose another --host or "
                                    "--port") from None


@contextmanager
def stop_requested() -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM (later ones are ignored while the service drains); the previous
    handlers come back on exit."""
    event = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: event.set()) for sig in STOP_SIGNALS}
    try:
        yield event
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def drain(timeout_s: float = DRAIN_TIMEOUT_S, max_calls: int = 64) -> None:
    """Drain every running replica (`TapsService.drain`: new requests get 503, running ones finish). A handle call
    reaches one replica of the router's choosing, so call until each replica has answered (or `max_calls`)."""
    from ray import serve  # late: only this command runs Ray Serve

    deployment = serve.status().applications[APP_NAME].deployments[DEPLOYMENT]
    running = deployment.replica_states.get("RUNNING", 0)
    handle = serve.get_app_handle(APP_NAME)
    drained: set[str] = set()
    for _ in range(max_calls):
        if len(drained) >= running:
            return
        drained.add(handle.drain.remote(timeout_s).result(timeout_s=timeout_s + 30))


def cmd_serve(cfg: StudyConfig, host: str | None = None, port: int | None = None,
              base_dir: str | Path | None = None) -> None:
    """`taps serve`: a local loopback Ray (unless cfg.ray.address or RAY_ADDRESS names one to join), the app,
    then serve until SIGINT (Ctrl-C) or SIGTERM; drain, and shut down Serve and the Ray this call started."""
    import ray  # late: only this command runs Ray Serve
    from ray import serve  # late: as above

    host, port = host or cfg.serve.host, cfg.serve.port if port is None else port
    check_address(host, port)
    started_ray = start_ray(cfg.ray, local_env=QUIET_SERVE_ENV if cfg.serve.listener == "replica" else None)
    with stop_requested() as stop:  # after ray.init, which installs a SIGTERM handler of its own that exits at once
        try:
            url = start(cfg, host, port, base_dir)
            print(f"taps serve: {url}  (models: GET {url}/v1/models, health: GET {url}/healthz; Ctrl-C or SIGTERM "
                  "stops)", flush=True)
            while not stop.wait(1.0):
                pass
            print("taps serve: draining in-flight requests (new ones get 503), then stopping", flush=True)
            drain()
        finally:
            # the app before the rest: serve.shutdown alone would kill the HTTP proxy at once, cutting any stream
            # still running; a replica that is deleted fails what is left with a 503 (an error chunk and [DONE])
            serve.delete(APP_NAME)
            serve.shutdown()
            if started_ray:
                ray.shutdown()
    print("taps serve: stopped", flush=True)
