"""`serve.listener: replica`: the replica answers HTTP itself on serve.host:serve.port, and Serve starts no proxy.

Why: through Serve's proxy every streamed token of every request is a message of its own, replica to proxy over
Ray, then proxy to client; at 16 requests in flight that is 16 messages per decode step, each waking a few
threads of other processes. On a CPU replica those wakeups land on the cores its compute threads use, and a team
of OpenMP threads splits each kernel statically, so every displaced thread holds the other at the kernel's end:
served, the decode step ran 13-16% slower than the same engine alone (docs/serve.md, "On a CPU with native
bf16"). Here the replica's own event loop writes each step's chunks to the clients' sockets, as vLLM's API server
writes a step's outputs. The cost: one replica (no routing across replicas or nodes); config.py refuses more.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn


class _ReplicaServer(uvicorn.Server):
    """uvicorn inside a Ray actor: the process's signals are Ray's, so it installs no handlers of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class ReplicaListener:
    """The replica's HTTP server. The socket is bound and listening from construction (a port in use fails the
    replica's start with the address; a request that arrives before `start` waits in the backlog)."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as error:
            self.socket.close()
            raise RuntimeError(f"serve.listener=replica cannot listen on {host}:{port} ({error.strerror}): free the "
                               "port or set serve.port") from None
        self.socket.listen(2048)
        self._server: _ReplicaServer | None = None
        self._task: asyncio.Task | None = None

    def start(self, app: object) -> None:
        """Serve the ASGI `app` on the running event loop (Serve has already run the app's lifespan)."""
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
        self._server = _ReplicaServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self.socket]),
                                                            name="taps-replica-listener")

    async def stop(self) -> None:
        """Stop accepting and close the connections once their responses are done."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        self.socket.close()
