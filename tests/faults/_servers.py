"""The campaign's redis-servers, on loopback ports of its range, that it may restart.

Append-only with fsync on every write: a restart (SIGKILL, then start again) keeps every
acknowledged write, as a production Redis that holds idempotency records must. oncely's function
library is loaded at every start: a reply cut by a fault proxy then hits the function's run, not
a "function not found" answer.
"""

from __future__ import annotations

from tests._servers import OwnRedis
from tests._servers import free_port as _free_port

PORTS = range(24500, 26000)
"""Loopback ports this campaign may use for servers of its own."""


def free_port(start: int) -> int:
    """The first port of `PORTS` from *start* on that nothing listens on."""
    return _free_port(PORTS, start)


def durable_redis(port: int) -> OwnRedis:
    """A campaign's redis-server on *port* (not started), its files in a temporary directory."""
    return OwnRedis(None, "--appendonly", "yes", "--appendfsync", "always", port=port, library=True)
