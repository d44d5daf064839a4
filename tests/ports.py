"""Ports for tests whose processes rendezvous on this machine.

A port from the kernel's ephemeral range, free when the test picks it, can be taken by any
outgoing connection before the listener binds it, or by the connecting process's own socket
(TCP simultaneous open: a client retrying 127.0.0.1:P from source port P talks to itself and
the rendezvous never ends). A port below that range is not handed out to outgoing connections.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def listen_port() -> int:
    """A local port that is free now and outside the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port below the ephemeral range ({low})")
