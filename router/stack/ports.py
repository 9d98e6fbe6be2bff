"""Picking free local TCP ports inside a range.

Ranges keep concurrent users of one machine apart; probing by ``bind`` finds ports nobody holds
right now. There is a small window between the probe and the engine's own bind, which is why
callers pick all ports of a stack at once and start at a random offset.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

# Ranges used by the stack (the router and other tools use other ranges).
ENGINE_HTTP_PORTS = range(8100, 8300)
SIDE_CHANNEL_PORTS = range(5600, 5800)
KV_EVENTS_PORTS = range(5800, 6000)  # vLLM's KV event publishers and their replay endpoints
ROUTER_PORTS = range(8000, 8100)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_ports(count: int, candidates: range, exclude: Collection[int] = ()) -> list[int]:
    """``count`` distinct free ports from ``candidates``, none in ``exclude``.

    Raises ``RuntimeError`` when the range has too few free ports.
    """
    start = random.randrange(len(candidates))
    ordered = list(candidates[start:]) + list(candidates[:start])
    picked: list[int] = []
    for port in ordered:
        if port not in exclude and port_is_free(port):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise RuntimeError(f"fewer than {count} free ports in {candidates.start}-{candidates.stop - 1}")
