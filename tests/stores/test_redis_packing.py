"""The Redis store's async connections pack commands with hiredis: the same bytes on the wire
as redis-py's own Python packing, for every kind of argument the store sends."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

from oncely import Acquired, Replay
from oncely.stores.redis import RedisStore
from oncely.stores.redis._lanes import packer
from oncely.stores.redis._packing import _packing, packs_with_hiredis, use_hiredis
from tests.conftest import service_url

COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "0" * 40, 2, "oncely:{ns:a}", "oncely:{ns:é}", "v1:" + "f" * 64, 30_000, -1),
    ("EVALSHA", "0" * 40, 1, "k", b"\x00\xff binary \r\n result", memoryview(b"view"), 0),
    ("EVALSHA", "0" * 40, 1, "k", b"x" * 100_000),  # large values (the Python packer chunks)
    ("SCRIPT LOAD", "return 1"),  # a command name of two words is sent as two
    (b"CLIENT SETINFO", "LIB-NAME", "redis-py"),
    ("SCAN", 0, "MATCH", "oncely:*", "COUNT", 1000),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_hiredis_packing_sends_what_redis_py_sends(command: tuple[Any, ...]) -> None:
    plain = Connection()
    packed = _packing(Connection)()
    assert b"".join(packed.pack_command(*command)) == b"".join(plain.pack_command(*command))


def test_only_utf8_clients_and_every_connection_kind() -> None:
    """A client that encodes text otherwise keeps redis-py's packer; TLS and Unix-socket
    connections keep their own class beneath the packing."""

    class Pool:
        def __init__(self, connection_class: type, **kwargs: Any) -> None:
            self.connection_class = connection_class
            self.connection_kwargs = kwargs

    latin = Pool(Connection, encoding="latin-1")
    assert not use_hiredis(latin)
    assert latin.connection_class is Connection
    for kind in (Connection, SSLConnection, UnixDomainSocketConnection):
        pool = Pool(kind, encoding="UTF-8")
        assert use_hiredis(pool)
        assert issubclass(pool.connection_class, kind)
        assert pool.connection_class.pack_command is not kind.pack_command


def test_the_store_async_connections_pack_with_hiredis() -> None:
    """Claims and replays go through the hiredis-packed connections of the store's client."""
    store = RedisStore(service_url("ONCELY_TEST_REDIS_URL"), namespace=uuid.uuid4().hex[:12])

    async def main() -> None:
        lease, ttl = timedelta(seconds=30), timedelta(minutes=1)
        first = await store.aclaim("k", "fp", lease=lease, ttl=ttl)
        assert isinstance(first, Acquired)
        assert await store.acomplete("k", first.token, b"\x00result", ttl=ttl) is None
        again = await store.aclaim("k", "fp", lease=lease, ttl=ttl)
        assert isinstance(again, Replay)
        assert again.record.result == b"\x00result"
        entry = await store._async_entry()
        pool = entry.client.connection_pool
        assert pool.connection_class.__module__ == "oncely.stores.redis._packing"
        await store.aclose()

    asyncio.run(main())


STORE_COMMANDS: list[tuple[Any, ...]] = [
    command for command in COMMANDS if " " not in str(command[0]) and "SCAN" not in command
]
STORE_COMMANDS = [
    tuple(bytes(arg) if isinstance(arg, memoryview) else arg for arg in command)
    for command in STORE_COMMANDS
] + [("FCALL", "oncely_0123_claim", 1, "oncely:{ns:k}", "v1:ab", 30_000, 300_000, "0f" * 8)]


@pytest.mark.parametrize("command", STORE_COMMANDS, ids=lambda c: str(c[0]))
def test_the_lanes_pack_what_the_connections_pack(command: tuple[Any, ...]) -> None:
    """The lanes' packer (`oncely.stores.redis._lanes.packer`) sends the bytes that the sync
    connections and the hiredis-packed async ones send for the store's commands."""
    import redis.connection

    pack = packer(True)
    assert pack is not None
    sync_connection = redis.connection.Connection()
    assert b"".join(pack(command)) == b"".join(sync_connection.pack_command(*command))
    assert b"".join(pack(command)) == b"".join(Connection().pack_command(*command))


def test_which_pools_pack_with_hiredis() -> None:
    """Stock sync connections and hiredis-packed async ones do; a client that encodes text
    otherwise, has a packer of its own, or a connection class that packs otherwise does not."""
    import redis.connection

    class Pool:
        def __init__(self, connection_class: type, **kwargs: Any) -> None:
            self.connection_class = connection_class
            self.connection_kwargs = kwargs

    class OwnPacking(redis.connection.Connection):
        def pack_command(self, *args: Any) -> list[bytes]:
            return super().pack_command(*args)

    assert packer(False) is None
    for kind in (redis.connection.Connection, redis.connection.SSLConnection):
        assert packs_with_hiredis(Pool(kind))
        assert not packs_with_hiredis(Pool(kind, encoding="latin-1"))
        assert not packs_with_hiredis(Pool(kind, command_packer=object()))
    assert not packs_with_hiredis(Pool(OwnPacking))
    assert not packs_with_hiredis(Pool(Connection))  # async, before use_hiredis
    pool = Pool(Connection)
    assert use_hiredis(pool)
    assert packs_with_hiredis(pool)
