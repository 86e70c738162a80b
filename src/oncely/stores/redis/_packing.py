"""Pack the async client's commands with hiredis, as redis-py's sync client already does.

redis-py's sync connections pack commands with ``hiredis.pack_command`` when hiredis is
installed (``redis.connection.HiredisRespSerializer``); its asyncio connections always pack in
Python, which costs a batch call a few microseconds per item. `use_hiredis` gives the store's
own async pool the same serializer the sync client uses: same bytes on the wire (the tests
compare both for every kind of argument the store sends), less Python per command.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["packs_with_hiredis", "use_hiredis"]


def use_hiredis(pool: Any) -> bool:
    """Make the connections *pool* creates from now on pack with hiredis; return whether it
    did (not without hiredis, nor when the client encodes text otherwise than as UTF-8, which
    is all hiredis writes)."""
    if not _hiredis_can_pack(pool):
        return False
    pool.connection_class = _packing(pool.connection_class)
    return True


def packs_with_hiredis(pool: Any) -> bool:
    """Whether the connections of *pool* pack every command with ``hiredis.pack_command``: a
    sync pool's stock connections do when hiredis is installed, an async pool's once
    `use_hiredis` made them (and neither when the client encodes text otherwise than as UTF-8,
    or was given a packer of its own)."""
    if not _hiredis_can_pack(pool) or pool.connection_kwargs.get("command_packer") is not None:
        return False
    from redis.connection import AbstractConnection

    method = getattr(pool.connection_class, "pack_command", None)
    return method is AbstractConnection.pack_command or (
        getattr(method, "__module__", None) == __name__
    )


def _hiredis_can_pack(pool: Any) -> bool:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:  # pragma: no cover - every supported redis-py has it
        return False
    encoding = str(pool.connection_kwargs.get("encoding", "utf-8"))
    return bool(HIREDIS_AVAILABLE) and encoding.lower().replace("-", "").replace("_", "") == "utf8"


@functools.cache
def _packing(base: type) -> type:
    from redis.connection import HiredisRespSerializer

    serializer = HiredisRespSerializer()

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        return serializer.pack(*args)  # type: ignore[no-any-return]

    pack_command.__module__ = __name__  # what packs_with_hiredis looks for

    return type(base.__name__, (base,), {"pack_command": pack_command, "__module__": __name__})
