"""The listening TCP sockets of this test process and of every process it started, and which of them are off
loopback.

The Ray nodes a test session starts (`ray.init`, `ray.cluster_utils.Cluster`) are children of the test process,
and their workers, agents and Serve actors are children of the raylet, so the process tree holds every listener
of ours and none of the Ray clusters other users run on the same machine.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    ip: str
    port: int
    pid: int
    name: str


def own_pids() -> set[int]:
    """This process and all its descendants."""
    me = psutil.Process(os.getpid())
    return {me.pid, *(child.pid for child in me.children(recursive=True))}


def listeners(pids: set[int] | None = None) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) of these processes (default: `own_pids()`); a process that exits
    while it is read is left out."""
    found = []
    for pid in sorted(own_pids() if pids is None else pids):
        try:
            process = psutil.Process(pid)
            name = process.name()
            sockets = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found += [Listener(c.laddr.ip, c.laddr.port, pid, name) for c in sockets if c.status == psutil.CONN_LISTEN]
    return found


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped ::ffff:127.x.x.x; not 0.0.0.0, :: or any other address."""
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def exposed(found: list[Listener]) -> list[Listener]:
    """The listeners off loopback."""
    return [listener for listener in found if not is_loopback(listener.ip)]
