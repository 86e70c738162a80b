"""What the standalone and the cluster Redis store share (`_RedisStoreBase`): the verbs, the
sync and async ``_run`` paths, each event loop's client, and the translation of redis-py's
errors. `oncely.stores.redis.store` adds how each makes its clients."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from types import ModuleType
from typing import Any, ClassVar, TypeVar

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
from oncely.stores.redis._lanes import AsyncLane, Gate, SyncLane
from oncely.stores.redis._urls import _check_options

_S = TypeVar("_S", bound="_RedisStoreBase")
_L = TypeVar("_L", SyncLane, AsyncLane)


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
