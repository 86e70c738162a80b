"""`redis://`, `rediss://` and `redis+cluster://`: the lowest-latency stores.

Every transition is one Lua function (``lua/*.lua``) run by FCALL (EVALSHA on servers without
functions): one round trip, atomic on the server, and judged by the server's clock (``TIME``),
so workers whose clocks disagree cannot steal each other's leases. The ``clock`` option other
stores take is accepted and ignored. Records expire through Redis's own TTL (``PXAT`` on each
record's key).

One store object serves both worlds: sync callers use a `redis.Redis` (or `redis.RedisCluster`)
client, async callers a `redis.asyncio` client created on first use in each event loop. Both run
the same flows (`oncely.stores.redis._scripts`); the ``_run`` methods below are the only code that
differs. On a standalone server they send each call straight on a pooled connection of the client
(`oncely.stores.redis._lanes`). Every redis-py exception is translated in
`_RedisStoreBase._translated`.

The batch verbs (`oncely.BatchStore`) run one function over every item: one call on a single
server; on a cluster, one per slot the items fall in (sequential in sync code, concurrent in
async code), since a function's keys must share a slot and redis-py's cluster pipelines refuse
EVALSHA and FCALL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from types import ModuleType
from typing import Any, ClassVar, Final, TypeVar
from urllib.parse import unquote

from oncely._cancel import release_unused, shielded
from oncely._core.clock import Clock
from oncely._core.flow import adrive, drive
from oncely._core.records import ClaimResult, LeaseLost, Record, Status, StoreHealth
from oncely._deps import require
from oncely.errors import (
    ConfigurationError,
    StoreError,
    StoreUnavailableError,
)
from oncely.stores._machine import in_progress_refusal
from oncely.stores.redis import _codec, _scripts
from oncely.stores.redis._codec import BACKEND, Keyspace
from oncely.stores.redis._lanes import AsyncLane, Gate, SyncLane, lane_for, packer
from oncely.stores.redis._packing import packs_with_hiredis, use_hiredis
from oncely.stores.redis._pool import queuing_pool

__all__ = ["RedisClusterStore", "RedisStore"]

_S = TypeVar("_S", bound="_RedisStoreBase")
_L = TypeVar("_L", SyncLane, AsyncLane)

DEFAULT_PREFIX: Final = "oncely:"
"""The prefix of every record's name unless another is given."""


def _redis() -> ModuleType:
    return require("redis", extra="redis")


@dataclass(eq=False)
class _LoopClient:
    """The async client of one event loop, with its scripts."""

    client: Any
    scripts: _scripts.Scripts
    gate: Gate  # bounds the commands in flight: see _wait_for_connection
    lane: AsyncLane | None = None  # the direct path to the client's connections, if it has one
    ready: asyncio.Task[None] | None = None  # the client's start: see _async_entry
    started: bool = False  # the start succeeded: a call takes the entry as it is (_arun)
    guard: AsyncGenerator[None, None] | None = None  # see _close_with_loop
    closed: bool = False

    async def close_client(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):  # a dead connection is closed all the same
                await self.client.aclose()

    async def aclose(self) -> None:
        """Close the client, and finish the guard so the loop has nothing left to close."""
        await self.close_client()
        if self.guard is not None:
            await self.guard.aclose()


async def _close_with_loop(entry: _LoopClient) -> AsyncGenerator[None, None]:
    """An async generator the loop closes when it shuts down, taking the client with it.

    ``asyncio.run`` (and any runner that calls ``loop.shutdown_asyncgens()``) closes every live
    async generator before it closes the loop: that is the last moment the loop's connections
    can be closed cleanly, whether or not the application ever closes the store.
    """
    try:
        yield
    finally:
        await entry.close_client()


class _RedisStoreBase:
    """What the standalone and the cluster store share: everything but making clients."""

    backend: ClassVar[str] = BACKEND
    _cancel_safe: ClassVar[type[_RedisStoreBase]]  # see aclaim

    def __init__(
        self,
        *,
        namespace: str,
        prefix: str,
        clock: Clock | None,
        socket_timeout: float | None,
        socket_connect_timeout: float | None,
        retries: int,
        client_options: dict[str, Any],
    ) -> None:
        del clock  # leases and expiry are judged by the server's clock (TIME)
        self._redis = redis = _redis()
        # What a command is re-sent after (see _retry).
        self._retried: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
        # What _translated turns into oncely's errors; anything else passes through.
        self._failures: tuple[type[BaseException], ...] = (
            redis.RedisError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        _check_options(client_options)
        if retries < 0:
            raise ConfigurationError(f"retries must be 0 or more, not {retries}")
        self.namespace = namespace
        self._space = Keyspace(prefix, namespace)
        self._retries = retries
        self._options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout,
            **client_options,
            "decode_responses": False,
        }
        self._wait: float | None = socket_timeout  # the longest wait for a free connection
        self._max_connections: int = client_options.get("max_connections") or 100
        self._lock = threading.Lock()
        self._client: Any = None
        self._scripts: _scripts.Scripts | None = None
        self._lane: SyncLane | None = None
        self._loops: dict[asyncio.AbstractEventLoop, _LoopClient] = {}
        self._closed = False

    # -- clients: subclasses make them ---------------------------------------------------------

    def _new_client(self) -> Any:
        raise NotImplementedError

    def _new_async_client(self) -> Any:
        raise NotImplementedError

    def _new_lane(self, client: Any, lane_class: type[_L]) -> _L | None:
        """The direct path to *client*'s connections (`_lanes`), or None to use the client."""
        return None

    def _backoff(self) -> Any:
        return self._redis.backoff.ExponentialWithJitterBackoff(base=0.01, cap=0.25)

    def _retry(self, retry_class: Any) -> Any:
        # Re-send once after a connection error: that heals a pooled connection the server or a
        # proxy dropped (restart, idle timeout, CLIENT KILL) while a down server still fails in
        # milliseconds. Also after a timeout, on a fresh connection (redis-py disconnects
        # first): the script may have run with its reply lost, and without a re-send its own
        # claim would answer InProgress to every retry until the lease ends. A re-sent script
        # carries the same call id, which the script recognises, so the re-send answers as the
        # first would have (see _scripts); a late first copy finds its own effect just as well.
        # Bounded: at most `retries` re-sends, each waiting socket_timeout at most.
        return retry_class(self._backoff(), self._retries, supported_errors=self._retried)

    def _register(self, client: Any) -> _scripts.Scripts:
        return _scripts.Scripts(client, self._redis.exceptions)

    def _sync_scripts(self) -> _scripts.Scripts:
        scripts = self._scripts
        if scripts is None:
            with self._lock:
                self._check_open()
                if self._scripts is None:
                    self._client = self._new_client()
                    self._lane = self._new_lane(self._client, SyncLane)
                    self._scripts = self._register(self._client)
                scripts = self._scripts
        return scripts

    async def _async_entry(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        entry = self._loops.get(loop)
        if entry is None:
            with self._lock:
                self._check_open()
                entry = self._loops.get(loop)
                if entry is None:
                    for other in [other for other in self._loops if other.is_closed()]:
                        del self._loops[other]  # closed loops closed their clients already
                    client = self._new_async_client()
                    gate = Gate(self._max_connections)
                    lane = self._new_lane(client, AsyncLane)
                    entry = _LoopClient(client, self._register(client), gate, lane)
                    self._loops[loop] = entry
                    entry.ready = loop.create_task(self._start(loop, entry))
        ready = entry.ready
        assert ready is not None
        if ready.done():
            ready.result()  # raises if the start failed
        else:
            # Every caller waits for the start; shielded, so that one caller's cancellation
            # does not cancel it for the others.
            await asyncio.shield(ready)
        return entry

    async def _start(self, loop: asyncio.AbstractEventLoop, entry: _LoopClient) -> None:
        """Tie a new async client to its loop's shutdown, and prepare it before any use."""
        entry.guard = _close_with_loop(entry)
        await entry.guard.__anext__()  # from now on the loop tracks it
        try:
            await self._prepare_async(entry.client)
            entry.started = True
        except BaseException:
            with self._lock:
                if self._loops.get(loop) is entry:
                    del self._loops[loop]  # the next call starts afresh
            await entry.aclose()
            raise

    async def _prepare_async(self, client: Any) -> None:
        """Get a new async client ready before the loop's first command (nothing to do here)."""

    def _use_url_options(self, options: Mapping[str, Any]) -> None:
        """Let the URL's ``socket_timeout`` and ``max_connections`` win, as in redis-py."""
        self._wait = options.get("socket_timeout", self._wait)
        self._max_connections = options.get("max_connections") or self._max_connections

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed", backend=self.backend)

    # -- the one boundary where redis-py exceptions become oncely's -----------------------------

    def _translated(self, key: str, exc: BaseException) -> BaseException:
        """Return oncely's error for redis-py's (or the socket's) *exc* about *key*."""
        redis = self._redis
        if isinstance(exc, redis.ResponseError):
            if isinstance(exc, (redis.exceptions.ClusterError, redis.exceptions.TryAgainError)):
                return self._unavailable(key, exc)
            return _codec.rejected(key, str(exc))
        if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
            return StoreError(f"Redis refused this client: {exc}", backend=self.backend)
        if isinstance(
            exc,
            (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.exceptions.ClusterError,
                redis.exceptions.RedisClusterException,
                OSError,
            ),
        ):
            return self._unavailable(key, exc)
        if isinstance(exc, redis.RedisError):
            return StoreError(f"Redis failed on {key!r}: {exc}", backend=self.backend)
        return exc

    @contextlib.contextmanager
    def _translate_errors(self, key: str) -> Iterator[None]:
        """Raise oncely's errors for redis-py's (see `_translated`)."""
        try:
            yield
        except self._failures as exc:
            raise self._translated(key, exc) from exc

    def _unavailable(self, key: str, exc: BaseException) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"Redis could not serve {key!r}: {type(exc).__name__}: {exc}", backend=self.backend
        )

    # -- performing a flow's script call, in each world ----------------------------------------

    def _run(self, script: str, key: str, keys: list[bytes], args: Sequence[Any]) -> Any:
        """Run *script* on *keys* with *args*; *key* names the call in error messages.

        One FCALL (or EVALSHA), on the lane (`_lanes`) or else by ``execute_command``; only
        when it fails does `_scripts.Scripts.recover` load what the server lacks and run it
        again, the same way.
        """
        try:
            if self._closed:
                self._check_open()
            scripts = self._scripts
            if scripts is None:
                scripts = self._sync_scripts()
            client = scripts.client
            command = (*scripts.heads[script], len(keys), *keys, *args)
            lane = self._lane
            try:
                if lane is not None:
                    return lane.call(command)
                return client.execute_command(*command)
            except self._redis.ResponseError as exc:
                flow = scripts.recover(script, keys, args, exc)
                if lane is not None:
                    return drive(flow, lane.call)
                return drive(flow, lambda command: client.execute_command(*command))
        except self._failures as exc:
            raise self._translated(key, exc) from exc

    async def _arun(self, script: str, key: str, keys: list[bytes], args: Sequence[Any]) -> Any:
        """Async `_run`."""
        try:
            if self._closed:
                self._check_open()
            entry = self._loops.get(asyncio.get_running_loop())
            if entry is None or not entry.started:
                entry = await self._async_entry()
            gate = entry.gate
            if gate.free:
                gate.free -= 1
            else:
                await self._wait_for_connection(key, gate)
            try:
                scripts = entry.scripts
                client = scripts.client
                command = (*scripts.heads[script], len(keys), *keys, *args)
                lane = entry.lane
                try:
                    if lane is not None:
                        return await lane.call(command)
                    return await client.execute_command(*command)
                except self._redis.ResponseError as exc:
                    flow = scripts.recover(script, keys, args, exc)
                    if lane is not None:
                        return await adrive(flow, lane.call)
                    return await adrive(flow, lambda command: client.execute_command(*command))
            finally:
                gate.release()
        except self._failures as exc:
            raise self._translated(key, exc) from exc

    async def _wait_for_connection(self, key: str, gate: Gate) -> None:
        """Queue for one of the loop's ``max_connections`` (as long as for a reply at most).

        redis-py's async pools raise MaxConnectionsError at once past ``max_connections``
        commands in flight (its blocking pool queues, but costs twice the pool's time on every
        command), so each loop's commands go through a `Gate` of that size instead.
        """
        try:
            await gate.wait(self._wait)
        except asyncio.TimeoutError as exc:
            raise StoreUnavailableError(
                f"Redis could not serve {key!r}: no connection free within {self._wait} s "
                f"(max_connections={self._max_connections})",
                backend=self.backend,
            ) from exc

    def _perform(self, call: _scripts.ScriptCall) -> Any:
        return self._run(call.script, call.key, [call.record], call.args)

    async def _aperform(self, call: _scripts.ScriptCall) -> Any:
        return await self._arun(call.script, call.key, [call.record], call.args)

    def _perform_batch(self, call: _scripts.BatchCall) -> Any:
        """Run a batch in one EVALSHA (the cluster store overrides this)."""
        return self._run(call.script, call.key, call.keys, call.args)

    async def _aperform_batch(self, call: _scripts.BatchCall) -> Any:
        """Async `_perform_batch`."""
        return await self._arun(call.script, call.key, call.keys, call.args)

    def _finish(
        self, verb: str, key: str, token: int, outcome: bytes, ttl: timedelta
    ) -> LeaseLost | None:
        """Complete or fail (*verb*): one round trip, no flow (see `_scripts.finish_args`)."""
        args = _scripts.finish_args(token, outcome, ttl)
        return _codec.settle_answer(key, self._run(verb, key, [self._space.name(key)], args))

    async def _afinish(
        self, verb: str, key: str, token: int, outcome: bytes, ttl: timedelta
    ) -> LeaseLost | None:
        """Async `_finish`; it lands even if its caller is cancelled (see `aclaim`)."""
        args = _scripts.finish_args(token, outcome, ttl)
        keys = [self._space.name(key)]
        try:
            reply = await self._arun(verb, key, keys, args)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await shielded(self._arun(verb, key, keys, args))
            raise
        return _codec.settle_answer(key, reply)

    # -- sync verbs ----------------------------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`. One round trip, judged by the server's clock."""
        args = _scripts.claim_args(fingerprint, lease, ttl)
        return _codec.claim_answer(key, self._run("claim", key, [self._space.name(key)], args))

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`. One round trip."""
        return self._finish("complete", key, token, result, ttl)

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.fail`. One round trip."""
        return self._finish("fail", key, token, error, ttl)

    def release(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.SyncStore.release`. One round trip."""
        return drive(_scripts.release(self._space, key, token), self._perform)

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.extend`. One round trip."""
        return drive(_scripts.extend(self._space, key, token, lease), self._perform)

    def get(self, key: str) -> Record | None:
        """See `oncely.SyncStore.get`: the record if it is live by the server's clock."""
        return drive(_scripts.get(self._space, key), self._perform)

    # -- async verbs ---------------------------------------------------------------------------

    # A caller cancelled while its claim or finish is in flight: the script may have run with
    # its reply lost. Each call carries an id of its own, so sending it again (shielded) finds
    # its own effect: a claim's lease is then given back, a finish has landed. So the entry
    # points await these verbs directly, without a task of their own to shield them
    # (`_cancel_safe`): one task and two turns of the event loop less on every call.

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`; a cancelled caller's lease is given back."""
        args = _scripts.claim_args(fingerprint, lease, ttl)
        keys = [self._space.name(key)]
        try:
            reply = await self._arun("claim", key, keys, args)
        except asyncio.CancelledError:
            await shielded(self._give_back(key, keys, args))
            raise
        return _codec.claim_answer(key, reply)

    async def _give_back(self, key: str, keys: list[bytes], args: Sequence[Any]) -> None:
        """Send the claim *args* again, and release the lease it took (its caller is gone)."""
        try:
            answer = _codec.claim_answer(key, await self._arun("claim", key, keys, args))
        except Exception:
            return  # not known: a lease it took expires on its own
        await release_unused(self, key, answer)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`."""
        return await self._afinish("complete", key, token, result, ttl)

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.afail`."""
        return await self._afinish("fail", key, token, error, ttl)

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.AsyncStore.arelease`."""
        return await adrive(_scripts.release(self._space, key, token), self._aperform)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.AsyncStore.aextend`."""
        return await adrive(_scripts.extend(self._space, key, token, lease), self._aperform)

    async def aget(self, key: str) -> Record | None:
        """See `oncely.AsyncStore.aget`."""
        return await adrive(_scripts.get(self._space, key), self._aperform)

    # -- batch verbs ---------------------------------------------------------------------------

    def claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.claim_many`. One round trip (per slot on a cluster).

        *ops*, one per request, are the claims' call ids (new ones when omitted): a batch sent
        again with the same ids, after a reply that never came, gets its own applied claims
        back as `Acquired` (not `InProgress`)."""
        flow = _scripts.claim_many(self._space, requests, lease, ttl, ops)
        return drive(flow, self._perform_batch)

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.complete_many`. One round trip (per slot on a cluster)."""
        return drive(_scripts.complete_many(self._space, items, ttl), self._perform_batch)

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.aclaim_many`."""
        flow = _scripts.claim_many(self._space, requests, lease, ttl, ops)
        return await adrive(flow, self._aperform_batch)

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.acomplete_many`."""
        return await adrive(_scripts.complete_many(self._space, items, ttl), self._aperform_batch)

    # -- maintenance ---------------------------------------------------------------------------

    def scan(self, *, after: str = "", limit: int = 100) -> list[Record]:
        """List live records in key order, without their results.

        Redis keeps no order: each call SCANs every record name of the namespace (on every
        primary of a cluster), then reads the *limit* first records, one round trip each. Meant
        for the CLI and occasional inspection, not for hot paths.

        Args:
            after: Only keys that sort after this one (the last key of the previous page).
            limit: At most this many records.

        Returns:
            The records, with ``result`` left out (``None``).

        Raises:
            StoreUnavailableError: The server could not be reached.
        """
        with self._translate_errors(""):
            self._check_open()
            self._sync_scripts()  # makes the sync client
            names = self._client.scan_iter(match=self._space.pattern(), count=1000)
            keys = (self._space.key_of(name) for name in names)
            candidates = sorted({key for key in keys if key is not None and key > after})
        # A record SCAN listed may have expired before it is read: read on past it, since a
        # page shorter than *limit* tells the caller there is nothing after it.
        records: list[Record] = []
        for key in candidates:
            if len(records) >= limit:
                break
            record = self.get(key)
            if record is not None:
                records.append(replace(record, result=None))
        return records

    def purge(self, *, batch: int = 1000, limit: int | None = None) -> int:
        """Do nothing: Redis deletes each record when it expires (its TTL).

        Args:
            batch: Ignored (accepted like the SQL stores' ``purge``).
            limit: Ignored.

        Returns:
            0, the number of records this call deleted.
        """
        del batch, limit
        return 0

    def migrate(self) -> None:
        """Do nothing: a Redis store has no schema (accepted like the SQL stores' ``migrate``)."""

    def forget(self, key: str, *, force: bool = False) -> Status | None:
        """See `oncely.stores.memory.MemoryStore.forget`. One round trip."""
        return self._forgotten(key, drive(_scripts.forget(self._space, key, force), self._perform))

    async def aforget(self, key: str, *, force: bool = False) -> Status | None:
        """Async `forget`."""
        flow = _scripts.forget(self._space, key, force)
        return self._forgotten(key, await adrive(flow, self._aperform))

    @staticmethod
    def _forgotten(key: str, answer: tuple[Status | None, bool]) -> Status | None:
        status, refused = answer
        if refused:
            raise in_progress_refusal(key)
        return status

    def check(self) -> StoreHealth:
        """See `oncely.CheckableStore.check`: a PING (to every primary of a cluster)."""
        started = time.perf_counter()
        with self._translate_errors("the check"):
            self._check_open()
            self._sync_scripts()  # makes the sync client
            self._client.ping()
        return StoreHealth(self.backend, None, (time.perf_counter() - started) * 1000)

    async def acheck(self) -> StoreHealth:
        """Async `check`."""
        started = time.perf_counter()
        with self._translate_errors("the check"):
            self._check_open()
            await (await self._async_entry()).client.ping()
        return StoreHealth(self.backend, None, (time.perf_counter() - started) * 1000)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sync client and every event loop's async client. Idempotent.

        An event loop that is running elsewhere closes its client on its own thread; a loop
        already closed without ``shutdown_asyncgens()`` (which ``asyncio.run`` calls) cannot
        close its sockets any more, and leaves them to the garbage collector.
        """
        for loop, entry in self._shut():
            if loop.is_closed():
                continue
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(entry.aclose(), loop)
            else:
                loop.run_until_complete(entry.aclose())

    async def aclose(self) -> None:
        """Close the current event loop's client, the sync client, and the other loops' ones."""
        current = asyncio.get_running_loop()
        for loop, entry in self._shut():
            if loop is current:
                await entry.aclose()
            elif not loop.is_closed() and loop.is_running():
                asyncio.run_coroutine_threadsafe(entry.aclose(), loop)

    def _shut(self) -> list[tuple[asyncio.AbstractEventLoop, _LoopClient]]:
        """Mark the store closed, close the sync client, and hand over the async ones."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            client, self._client, self._scripts = self._client, None, None
            self._lane = None
            loops, self._loops = list(self._loops.items()), {}
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        return loops

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self: _S) -> _S:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuse the client options (or URL parameters) that would break the store."""
    if options.get("decode_responses") not in (None, False):
        raise ConfigurationError("the Redis store needs decode_responses=False (results are bytes)")
    if "retry" in options or "retry_on_timeout" in options:
        raise ConfigurationError(
            "the Redis store sets up retries itself: pass retries=<n> (0 to fail at once)"
        )


_URL_PARTS: Final = frozenset({"host", "port", "path", "db", "username", "password"})


def _check_url(
    redis: ModuleType,
    url: str,
    options: Mapping[str, Any],
    *more: type,
    also: Sequence[str] = (),
) -> None:
    """Refuse what redis-py's URL parser lets through to go wrong later: a database that is
    not a number (``redis://host/cache`` silently meant database 0) and query parameters that
    no connection takes (a ``TypeError`` at the first command, or dropped unsaid). *more* are
    classes whose parameters count too, *also* more names."""
    if url.partition("://")[0].lower() in ("redis", "rediss"):
        path = url.partition("://")[2].partition("?")[0].partition("/")[2]
        if path and not (path.isascii() and path.isdigit()):
            raise ConfigurationError(f"the database is a number (/0, /1…), not {path!r}")
    classes: list[type] = [redis.ConnectionPool, *more]
    connection_class = options.get("connection_class", redis.connection.Connection)
    classes.extend(getattr(connection_class, "__mro__", (connection_class,)))
    accepted = {*_URL_PARTS, *also}
    for cls in classes:
        init = vars(cls).get("__init__")
        if init is not None:
            with contextlib.suppress(TypeError, ValueError):  # a builtin: no signature
                accepted.update(inspect.signature(init).parameters)
    unknown = sorted(set(options) - accepted - {"connection_class"})
    if unknown:
        raise ConfigurationError(f"unknown parameters {unknown}: no Redis connection takes them")


def _masked(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{hosts}" if ":" in userinfo else url


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


def _parse_cluster_url(redis: ModuleType, url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Split ``redis+cluster://[auth@]h:p,h:p[/0][?query]`` into startup nodes and options."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "redis+cluster" or not rest:
        raise ConfigurationError(
            f"a Redis Cluster URL is redis+cluster://host:port,…, not {_masked(url)!r}"
        )
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for address in hosts.split(","):
        host, colon, port = address.strip().rpartition(":")
        if not colon:
            host, port = address.strip(), "6379"
        host = host.strip("[]")
        if not host or not (port.isascii() and port.isdigit()):
            raise ConfigurationError(
                f"bad node {address!r} in the Redis Cluster URL {_masked(url)!r}"
            )
        nodes.append((unquote(host), int(port)))
    single = f"redis://{userinfo}{at}{hosts.split(',')[0]}{slash}{path}"
    try:
        options: dict[str, Any] = redis.connection.parse_url(
            f"{single}?{query}" if query else single
        )
    except ValueError as exc:
        raise ConfigurationError(f"malformed Redis Cluster URL {_masked(url)!r}: {exc}") from exc
    _check_options(options)
    try:
        cluster = redis.cluster
        allowed = getattr(cluster, "REDIS_ALLOWED_KEYS", ())  # what it passes to each node
        _check_url(redis, single, options, cluster.RedisCluster, also=allowed)
    except ConfigurationError as exc:
        raise ConfigurationError(f"malformed Redis Cluster URL {_masked(url)!r}: {exc}") from exc
    if options.pop("db", 0) not in (0, "0"):
        raise ConfigurationError("a Redis Cluster has only database 0")
    options.pop("host", None)
    options.pop("port", None)
    return nodes, options


RedisStore._cancel_safe = RedisStore
RedisClusterStore._cancel_safe = RedisClusterStore
