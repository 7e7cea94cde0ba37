"""A free loopback port for a test's server, chosen where nothing else will take it before the server binds."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RAY_WORKER_PORTS_END = 20000  # Ray's workers listen on 10002-19999 by default


def _ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' local ports (Linux's default where it cannot be read)."""
    try:
        low, high = map(int, EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A port of 127.0.0.1 that binds now, outside the ephemeral range and Ray's worker ports.

    A port the kernel hands out (binding port 0) lies in the ephemeral range, so any outgoing connection made
    before the server binds (Ray starts dozens) can take it, and the server fails with "address already in use".
    """
    ephemeral = _ephemeral_ports()
    candidates = [port for port in range(RAY_WORKER_PORTS_END, 65536) if port not in ephemeral]
    for port in random.sample(candidates, len(candidates)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port on 127.0.0.1 outside the ephemeral range")
