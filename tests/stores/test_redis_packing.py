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
from oncely.stores.redis._packing import _packing, use_hiredis
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
