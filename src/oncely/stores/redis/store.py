"""`redis://`, `rediss://` and `redis+cluster://`: the lowest-latency stores.

Every transition is one Lua function (``lua/*.lua``) run by FCALL (EVALSHA on servers without
functions): one round trip, atomic on the server, and judged by the server's clock (``TIME``),
so workers whose clocks disagree cannot steal each other's leases. The ``clock`` option other
stores take is accepted and ignored. Records expire through Redis's own TTL (``PXAT`` on each
record's key).

One store object serves both worlds: sync callers use a `redis.Redis` (or `redis.RedisCluster`)
client, async callers a `redis.asyncio` client created on first use in each event loop. Both run
the same flows (`oncely.stores.redis._scripts`); the ``_run`` methods of `_RedisStoreBase`
(`oncely.stores.redis._base`, with everything both stores share) are the only code that differs.
On a standalone server they send each call straight on a pooled connection of the client
(`oncely.stores.redis._lanes`). Every redis-py exception is translated in
`_RedisStoreBase._translated`.

The batch verbs (`oncely.BatchStore`) run one function over every item: one call on a single
server; on a cluster, one per slot the items fall in (sequential in sync code, concurrent in
async code), since a function's keys must share a slot and redis-py's cluster pipelines refuse
EVALSHA and FCALL.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Final

from oncely._core.clock import Clock
from oncely._deps import require
from oncely.errors import (
    ConfigurationError,
    StoreError,
)
from oncely.stores.redis import _scripts
from oncely.stores.redis._base import _L, _RedisStoreBase
from oncely.stores.redis._lanes import lane_for, packer
from oncely.stores.redis._packing import packs_with_hiredis, use_hiredis
from oncely.stores.redis._pool import queuing_pool
from oncely.stores.redis._urls import _check_options, _check_url, _masked, _parse_cluster_url

__all__ = ["RedisClusterStore", "RedisStore"]

DEFAULT_PREFIX: Final = "oncely:"
"""The prefix of every record's name unless another is given."""


class RedisStore(_RedisStoreBase):
    """Records in one Redis server (or a proxy in front of several), as one string each.

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]`` or ``rediss://…`` for TLS, with
            redis-py's query parameters (``?socket_timeout=2``…).
        namespace: Keeps this store's keys apart from other stores' on the same server.
        prefix: Starts the name of every record's key (``oncely:`` by default).
        clock: Accepted for symmetry with other stores and ignored: the server's ``TIME``
            judges every lease and expiry.
        socket_timeout: Seconds to wait for a reply before `StoreUnavailableError`.
        socket_connect_timeout: Seconds to wait for a connection.
        retries: How often a command is re-sent after a connection error or a timeout (0:
            never), on a fresh connection. A re-sent script that finds its first copy ran
            answers as the first reply would have (each call carries an id of its own).
        **client_options: Passed to both redis-py clients (``max_connections``,
            ``ssl_ca_certs``, ``client_name``…).

    Raises:
        ConfigurationError: The URL or an option is malformed.
        MissingDependencyError: redis-py is not installed (``pip install 'oncely[redis]'``).

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        namespace: str = "",
        prefix: str = DEFAULT_PREFIX,
        clock: Clock | None = None,
        socket_timeout: float | None = 5.0,
        socket_connect_timeout: float | None = 2.0,
        retries: int = 1,
        **client_options: Any,
    ) -> None:
        super().__init__(
            namespace=namespace,
            prefix=prefix,
            clock=clock,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            retries=retries,
            client_options=client_options,
        )
        try:
            url_options = self._redis.connection.parse_url(url)
            _check_options(url_options)
            _check_url(self._redis, url, url_options)
        except ValueError as exc:  # incl. ConfigurationError
            raise ConfigurationError(f"malformed Redis URL {_masked(url)!r}: {exc}") from exc
        self.url = url
        self._use_url_options(url_options)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """Open ``redis://…`` or ``rediss://…``; what `oncely.open_store` calls.

        Args:
            url: The server's URL.
            **options: The keyword arguments of the class.

        Returns:
            The store; it connects on first use.
        """
        return cls(url, **options)

    def _new_client(self) -> Any:
        retry = self._retry(self._redis.retry.Retry)
        pool_class = queuing_pool(self._redis.ConnectionPool)
        pool = pool_class.from_url(self.url, retry=retry, **self._pooled())
        return self._redis.Redis.from_pool(pool)

    def _new_async_client(self) -> Any:
        asyncio_redis = require("redis.asyncio", extra="redis")
        retry = self._retry(require("redis.asyncio.retry", extra="redis").Retry)
        client = asyncio_redis.Redis.from_url(self.url, retry=retry, **self._options)
        use_hiredis(client.connection_pool)
        return client

    def _new_lane(self, client: Any, lane_class: type[_L]) -> _L | None:
        pool = client.connection_pool
        if not lane_for(pool):
            return None
        pack = packer(packs_with_hiredis(pool))
        return lane_class(pool, self._retries, self._backoff(), self._retried, pack)

    def _pooled(self) -> dict[str, Any]:
        """The client options, for a sync pool that queues the threads past its size.

        redis-py's default pool raises at once when ``max_connections`` (100) commands are in
        flight; `queuing_pool` makes the next thread wait for a free connection, for as long
        as it would wait for a reply.
        """
        return {**self._options, "max_connections": self._max_connections, "timeout": self._wait}

    def __repr__(self) -> str:
        return f"RedisStore({_masked(self.url)!r}, namespace={self.namespace!r})"


class RedisClusterStore(_RedisStoreBase):
    """Records in a Redis Cluster: each record is one key, so it lives in one slot.

    Args:
        url: ``redis+cluster://[[user]:password@]host:port[,host:port…]`` naming one or more
            startup nodes; the client discovers the others. Query parameters as for
            `RedisStore`; TLS with ``ssl=True``.
        namespace: Keeps this store's keys apart from other stores' on the same cluster.
        prefix: Starts the name of every record's key (``oncely:`` by default).
        clock: Accepted and ignored: the ``TIME`` of the node owning a record judges it.
        socket_timeout: Seconds to wait for a reply before `StoreUnavailableError`.
        socket_connect_timeout: Seconds to wait for a connection.
        retries: How often the cluster client retries a command after a connection error or a
            cluster reconfiguration (``CLUSTERDOWN``, a failover) before giving up.
        **client_options: Passed to both redis-py cluster clients.

    Raises:
        ConfigurationError: The URL or an option is malformed.
        MissingDependencyError: redis-py is not installed (``pip install 'oncely[redis]'``).

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "",
        prefix: str = DEFAULT_PREFIX,
        clock: Clock | None = None,
        socket_timeout: float | None = 5.0,
        socket_connect_timeout: float | None = 2.0,
        retries: int = 1,
        **client_options: Any,
    ) -> None:
        super().__init__(
            namespace=namespace,
            prefix=prefix,
            clock=clock,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            retries=retries,
            client_options=client_options,
        )
        self.url = url
        self.nodes, url_options = _parse_cluster_url(self._redis, url)
        self._options = {**self._options, **url_options}  # the URL wins, as in redis-py
        self._use_url_options(url_options)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisClusterStore:
        """Open ``redis+cluster://host:port,host:port,…``; what `oncely.open_store` calls.

        Args:
            url: The startup nodes' URL.
            **options: The keyword arguments of the class.

        Returns:
            The store; it connects to the cluster on first use.
        """
        return cls(url, **options)

    def _new_client(self) -> Any:
        cluster = self._redis.cluster
        return _routing_fcall(cluster.RedisCluster)(
            startup_nodes=[cluster.ClusterNode(host, port) for host, port in self.nodes],
            retry=self._retry(self._redis.retry.Retry),
            **self._options,
        )

    def _perform_batch(self, call: _scripts.BatchCall) -> Any:
        """Run a batch as one EVALSHA per slot, one after the other, answers in item order.

        A slot's call that fails after another succeeded leaves its error in its items' places
        (the answers already got are kept: a lease taken is never lost to the caller); a
        failure before any success fails the whole call.
        """
        parts: list[tuple[list[int], list[Any] | StoreError]] = []
        for indices, part in call.split(self._redis.crc.key_slot):
            try:
                parts.append((indices, self._run(part.script, part.key, part.keys, part.args)))
            except StoreError as exc:
                if not parts:
                    raise
                parts.append((indices, exc))
        return call.merge(parts)

    async def _aperform_batch(self, call: _scripts.BatchCall) -> Any:
        """Async `_perform_batch`: the slots' calls run concurrently; if all fail, it raises."""

        async def run(
            indices: list[int], part: _scripts.BatchCall
        ) -> tuple[list[int], list[Any] | StoreError]:
            try:
                return indices, await self._arun(part.script, part.key, part.keys, part.args)
            except StoreError as exc:
                return indices, exc

        parts = call.split(self._redis.crc.key_slot)
        return call.merge(await asyncio.gather(*(run(*part) for part in parts)))

    async def _prepare_async(self, client: Any) -> None:
        # Learn the slot map before the first command: redis-py's async cluster client sends
        # commands that arrive while it initialises to a default node, and the MOVED replies
        # make it refresh the topology under the feet of concurrent commands.
        await client.initialize()

    def _new_async_client(self) -> Any:
        cluster = require("redis.asyncio.cluster", extra="redis")
        return _routing_fcall(cluster.RedisCluster)(
            startup_nodes=[cluster.ClusterNode(host, port) for host, port in self.nodes],
            retry=self._retry(require("redis.asyncio.retry", extra="redis").Retry),
            **self._options,
        )

    def __repr__(self) -> str:
        return f"RedisClusterStore({_masked(self.url)!r}, namespace={self.namespace!r})"


@functools.cache
def _routing_fcall(base: type) -> type:
    """A subclass of redis-py's cluster client *base* (sync or async) that sends the store's
    FCALLs to the slot of their first key, as redis-py does for EVALSHA: for an FCALL it asks
    the server for the command's keys (``COMMAND GETKEYS``), one round trip more per call.
    The slots of a batch's keys are one (`_scripts.BatchCall.split`); the server checks it."""
    namespace: dict[str, Any] = {"__module__": __name__}
    if inspect.iscoroutinefunction(getattr(base, "_determine_slot", None)):

        async def _determine_slot(self: Any, command: str, *args: Any) -> Any:
            if command == "FCALL" and len(args) > 2 and args[1]:
                return self.keyslot(args[2])
            return await base._determine_slot(self, command, *args)  # type: ignore[attr-defined]

        namespace["_determine_slot"] = _determine_slot
    else:

        def determine_slot(self: Any, *args: Any) -> Any:
            if args[0] == "FCALL" and len(args) > 3 and args[2]:
                return self.keyslot(args[3])
            return base.determine_slot(self, *args)  # type: ignore[attr-defined]

        namespace["determine_slot"] = determine_slot
    return type(base.__name__, (base,), namespace)


RedisStore._cancel_safe = RedisStore
RedisClusterStore._cancel_safe = RedisClusterStore
