"""`Relay`: publishes committed outbox events, in each scope's commit order, at least once.

A scope is an ordering key and a destination. One cycle claims a batch (`_sql` explains how
claims keep each scope's order across relays), hands it to the `Publisher`, and records each
event's outcome: published, failed (counted, and retried after an exponential backoff),
dead-lettered after ``max_attempts`` failures, or left as it was (not attempted). A failure of
the whole publish call (the broker is down) counts against no event: the relay backs off and
tries again, and nothing is lost meanwhile. A call that times out is narrowed down to the event
it hangs on, whose failure it is (`Relay._publish`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from oncely import _events as _stream
from oncely import _observed
from oncely._core.policy import Duration, to_timedelta
from oncely._log import fields, get_logger
from oncely.errors import ConfigurationError, MissingDependencyError, SchemaMissingError
from oncely.outbox import _sql
from oncely.outbox._event import (
    NOT_ATTEMPTED,
    OutboxEvent,
    Outcome,
    Publisher,
    Scope,
    in_order,
    scope,
)
from oncely.outbox._writer import check_store

__all__ = ["Relay"]

logger = get_logger("oncely.outbox")

_MAX_BATCH = 10_000
_MAX_ERROR = 2000
"""Characters of an error message kept in ``last_error``."""
_PURGE_BATCH = 1000
_WINDOW = 4
"""A claim looks for heads among the oldest ``batch_size`` times this many pending events first
(see `_sql.PG_HEADS`)."""
_SETUP_ERRORS = (ConfigurationError, MissingDependencyError, SchemaMissingError)


class Relay:
    """Publish the outbox's committed events through a `Publisher`.

    .. code-block:: python

        relay = Relay(store, KafkaPublisher.from_url("kafka://broker:9092"))
        await relay.run()            # until cancelled, or until the `stop` event given is set

    Several relays may run side by side on one PostgreSQL database: each claims its batch with
    ``FOR UPDATE SKIP LOCKED``, so in the normal case no event is published twice, and events of
    one ordering key to one destination (a *scope*) are published in commit order whichever
    relay takes them; a destination that refuses its events holds back only its own. Delivery
    is at least once: a relay that dies after the broker confirmed a batch but before it
    recorded that publishes nothing twice itself, but the next relay publishes the batch again;
    each message carries its message id as its idempotency key, for the consumer to
    deduplicate.

    Args:
        store: The `PostgresStore` or `SQLiteStore` the `Outbox` writes to.
        publisher: Sends batches to the broker (`oncely.outbox.Publisher`).
        batch_size: Events claimed and published per batch (what a batch holds in memory).
        poll_interval: How often to look for events without being woken. On PostgreSQL the
            relay also ``LISTEN``s for the outbox's ``NOTIFY`` and wakes at once.
        max_attempts: Failed attempts after which an event is dead-lettered: it is set aside
            (``dead_at``, ``last_error``), logged, and later events of its scope proceed.
        backoff: The wait before the first retry of a failed event; each further failure
            doubles it, up to *max_backoff*. The relay backs off the same way while the whole
            publish call fails.
        max_backoff: The longest wait between two attempts.
        retention: How long published events are kept before a purge deletes them.
        purge_interval: How often the relay purges.
        publish_timeout: How long one publish call may take. A call that takes longer is
            cancelled and its events published again in halves, until the call that times
            out holds one event: the timeout counts against that event. On SQLite the relay
            holds its claim on a batch about twice as long, renewed before each further call.
        listen: Wake on ``NOTIFY`` (PostgreSQL); ``False``: poll only.

    Raises:
        ConfigurationError: A bad setting, a store without SQL tables, or a publisher that is
            not one.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: Any,
        publisher: Publisher,
        *,
        batch_size: int = 100,
        poll_interval: Duration = 1.0,
        max_attempts: int = 10,
        backoff: Duration = 1.0,
        max_backoff: Duration = 300.0,
        retention: Duration = timedelta(days=1),
        purge_interval: Duration = 60.0,
        publish_timeout: Duration = 60.0,
        listen: bool = True,
    ) -> None:
        check_store(store, "the relay")
        if not isinstance(publisher, Publisher):
            raise ConfigurationError(
                f"a relay needs a Publisher (async publish and aclose), not "
                f"{type(publisher).__name__}"
            )
        for name, number, top in (
            ("batch_size", batch_size, _MAX_BATCH),
            ("max_attempts", max_attempts, 1_000_000),
        ):
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
                raise ConfigurationError(
                    f"{name} must be an integer from 1 to {top}, not {number!r}"
                )
        self.store = store
        self.publisher = publisher
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.poll_interval = to_timedelta(poll_interval, "poll_interval")
        self.backoff = to_timedelta(backoff, "backoff")
        self.max_backoff = to_timedelta(max_backoff, "max_backoff")
        self.retention = to_timedelta(retention, "retention")
        self.purge_interval = to_timedelta(purge_interval, "purge_interval")
        self.publish_timeout = to_timedelta(publish_timeout, "publish_timeout")
        self.listen = listen
        self._backend: _Backend = (
            _PostgresBackend(store)
            if store.backend == "postgres"
            else _SQLiteBackend(store, self.publish_timeout * 2 + timedelta(seconds=5))
        )
        self._claimed = 0

    # -- one cycle -----------------------------------------------------------------------------

    async def run_once(self) -> int:
        """Claim one batch, publish it and record the outcomes; return how many were published.

        Raises:
            Exception: What the publisher raised for the whole call (the events it did not
                answer are left as they were, their ``last_error`` set), a `TimeoutError` when
                nothing was confirmed before a call timed out, or a `StoreError`.
        """
        self._claimed = 0
        async with self._backend.claim(self.batch_size) as batch:
            events = batch.events
            self._claimed = len(events)
            if not events:
                return 0
            outcomes, failure = await self._publish(batch)
            note = None if failure is None else _describe(failure)
            settlement = self._settle(events, in_order(events, outcomes), note)
            await batch.settle(settlement)
        if failure is not None:
            raise failure
        return len(settlement.published)

    async def _publish(self, batch: _Batch) -> tuple[list[Outcome], Exception | None]:
        """Publish *batch*'s events; return their outcomes, and the failure that stopped it.

        A call that times out is cancelled and its events published again in two halves, and
        so on, until the call that times out holds one event: that timeout is the event's own
        failure, counted against it, and its scope's later events wait. Events the broker
        answered are not published again. When a lone event times out before anything was
        confirmed, the broker may be the one not answering: the rest is left for the next
        cycle (the timeout still counts against that event, the oldest one tried)."""
        events = batch.events
        outcomes: list[Outcome] = [NOT_ATTEMPTED] * len(events)
        blocked: set[Scope] = set()  # scopes with an event not confirmed: their later ones wait
        confirmed = False
        timeout = self.publish_timeout.total_seconds()
        parts = [list(range(len(events)))]  # a stack: the next part to try is the last
        calls = 0
        while parts:
            part = [i for i in parts.pop() if scope(events[i]) not in blocked]
            if not part:
                continue
            if calls:
                await batch.extend()
            calls += 1
            try:
                answers = await _within(self.publisher.publish([events[i] for i in part]), timeout)
            except _TimedOut as exc:
                if len(part) > 1:
                    half = (len(part) + 1) // 2
                    parts += [part[half:], part[:half]]
                    continue
                outcomes[part[0]] = TimeoutError(f"the publish call holding it {exc}")
                if (where := scope(events[part[0]])) is not None:
                    blocked.add(where)
                if not confirmed:
                    return outcomes, TimeoutError(f"a publish call {exc}")
                continue
            except Exception as exc:
                return outcomes, exc
            if len(answers) != len(part):
                error = ValueError(
                    f"the publisher answered {len(answers)} outcomes for {len(part)} events"
                )
                return outcomes, error
            for index, answer in zip(part, answers, strict=True):
                outcomes[index] = answer
                if answer is None:
                    confirmed = True
                elif (where := scope(events[index])) is not None:
                    blocked.add(where)
        return outcomes, None

    def _settle(
        self, events: Sequence[OutboxEvent], outcomes: Sequence[Outcome], note: str | None
    ) -> _Settlement:
        if _stream.on:
            _observed.relayed(events, outcomes, self.max_attempts)
        settlement = _Settlement(note=note)
        for event, outcome in zip(events, outcomes, strict=True):
            if outcome is None:
                settlement.published.append(event.id)
            elif outcome is NOT_ATTEMPTED or not isinstance(outcome, BaseException):
                settlement.untouched.append(event.id)
            else:
                attempts = event.attempts + 1
                dead = attempts >= self.max_attempts
                error = _describe(outcome)
                delay = self._delay(attempts)
                settlement.failed.append(_Failure(event.id, error, delay, dead))
                if dead:
                    logger.error(
                        "outbox event %s (message id %s, to %s) dead-lettered after %d "
                        "attempts: %s",
                        event.id,
                        event.message_id,
                        event.destination,
                        attempts,
                        error,
                        extra=fields(key=event.message_id, attempt=attempts, outcome="dead"),
                    )
                else:
                    logger.warning(
                        "outbox event %s (message id %s, to %s) failed, attempt %d of %d; "
                        "retrying in %.1f s: %s",
                        event.id,
                        event.message_id,
                        event.destination,
                        attempts,
                        self.max_attempts,
                        delay.total_seconds(),
                        error,
                        extra=fields(key=event.message_id, attempt=attempts, outcome="failed"),
                    )
        return settlement

    def _delay(self, failures: int) -> timedelta:
        delay: timedelta = self.backoff * 2 ** min(failures - 1, 40)
        return min(self.max_backoff, delay)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Publish until *stop* is set (or the task is cancelled); purge now and then.

        A batch under way when *stop* is set is finished first. A failing broker or database
        is logged and retried with backoff, never raised.

        Raises:
            SchemaMissingError: The outbox tables are missing: run ``migrate()``.
            ConfigurationError: A setting that waiting will not fix (from the publisher, say).
            MissingDependencyError: The publisher's client library is missing.
        """
        stop = stop if stop is not None else asyncio.Event()
        wake = asyncio.Event()
        listener = await self._backend.listen(wake) if self.listen else None
        failures = 0
        next_purge = time.monotonic()
        try:
            while not stop.is_set():
                wake.clear()  # a NOTIFY from here on wakes the pause below
                try:
                    if time.monotonic() >= next_purge:
                        next_purge = time.monotonic() + self.purge_interval.total_seconds()
                        await self.purge()
                    published = await self.run_once()
                    if _stream.on:
                        await _observed.backlog(self._backend)
                except _SETUP_ERRORS:
                    raise  # waiting would not help: the schema, a setting, a missing library
                except Exception as exc:
                    failures += 1
                    delay = self._delay(failures)
                    logger.warning(
                        "outbox relay: %s; trying again in %.1f s",
                        _describe(exc),
                        delay.total_seconds(),
                    )
                    await _pause(stop, None, delay)
                    continue
                failures = 0
                if published == 0 or self._claimed < self.batch_size:
                    await _pause(stop, wake, self.poll_interval)
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener

    def run_forever(self) -> None:
        """Run in a new event loop until SIGINT or SIGTERM, then close the publisher."""
        asyncio.run(self._until_signalled())

    async def _until_signalled(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = []
        for number in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(number, stop.set)
                handled.append(number)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread, or no signals here: cancel the loop instead
        try:
            await self.run(stop)
        finally:
            for number in handled:
                loop.remove_signal_handler(number)
            await self.aclose()

    async def purge(self) -> int:
        """Delete events published longer than ``retention`` ago; return how many."""
        return await self._backend.purge(self.retention)

    async def aclose(self) -> None:
        """Close the publisher and the relay's own connections (not the store)."""
        try:
            await self.publisher.aclose()
        finally:
            await self._backend.aclose()


async def _pause(stop: asyncio.Event, wake: asyncio.Event | None, timeout: timedelta) -> None:
    """Wait until *stop* (or *wake*) is set, or *timeout* has passed."""
    waiters = [asyncio.ensure_future(stop.wait())]
    if wake is not None:
        waiters.append(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(
            waiters, timeout=timeout.total_seconds(), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for waiter in waiters:
            waiter.cancel()


class _TimedOut(Exception):
    """A publish call the relay gave up on (not a `TimeoutError` the publisher raised)."""


async def _within(call: Awaitable[Sequence[Outcome]], timeout: float) -> Sequence[Outcome]:
    """Await *call*; cancel it and raise `_TimedOut` after *timeout* seconds."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait((task,), timeout=timeout)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise _TimedOut(f"did not return in {timeout:g} s")
    return task.result()


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_MAX_ERROR]


# -- outcomes -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Failure:
    id: int
    error: str
    delay: timedelta
    dead: bool


@dataclass(slots=True)
class _Settlement:
    """What to record for a batch: *note* is the failure that stopped it, if one did,
    recorded as the untouched events' ``last_error`` (not counted against them)."""

    published: list[int] = field(default_factory=list)
    failed: list[_Failure] = field(default_factory=list)
    untouched: list[int] = field(default_factory=list)
    note: str | None = None


class _Batch(Protocol):
    events: list[OutboxEvent]

    async def extend(self) -> None:
        """Keep the claim for another ``publish_timeout`` (before another call)."""

    async def settle(self, settlement: _Settlement) -> None: ...


class _Backend(Protocol):
    def claim(self, limit: int) -> contextlib.AbstractAsyncContextManager[_Batch]: ...

    async def listen(self, wake: asyncio.Event) -> asyncio.Task[None] | None: ...

    async def purge(self, retention: timedelta) -> int: ...

    async def stats(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


def _events(rows: Sequence[Sequence[Any]]) -> list[OutboxEvent]:
    events = []
    for event_id, message_id, destination, payload, headers, ordering_key, attempts in rows:
        if isinstance(headers, str):
            headers = json.loads(headers)
        events.append(
            OutboxEvent(
                id=event_id,
                message_id=message_id,
                destination=destination,
                payload=bytes(payload),
                headers=headers,
                ordering_key=ordering_key,
                attempts=attempts,
            )
        )
    events.sort(key=lambda event: event.id)  # within a key, id order is commit order
    return events


def _scopes(rows: Sequence[Sequence[Any]]) -> list[tuple[str, str]]:
    """The (ordering key, destination) pairs of the keyed event rows, each once."""
    return list(dict.fromkeys((row[5], row[2]) for row in rows if row[5] is not None))


def _ms(duration: timedelta) -> int:
    return int(duration // timedelta(milliseconds=1))


# -- PostgreSQL -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Subject:
    subject: str = "the outbox"


class _PostgresBatch:
    def __init__(self, queries: _sql.PostgresQueries, connection: Any) -> None:
        self._queries = queries
        self._connection = connection
        self.events: list[OutboxEvent] = []

    async def load(self, limit: int) -> None:
        queries, connection = self._queries, self._connection
        window = {"limit": limit, "window": limit * _WINDOW}
        heads = await (await connection.execute(queries.heads, window)).fetchall()
        scopes = _scopes(heads)
        if scopes and len(heads) < limit:
            params = {
                "keys": [key for key, _ in scopes],
                "destinations": [destination for _, destination in scopes],
                "ids": [row[0] for row in heads],
                "limit": limit - len(heads),
            }
            heads += await (await connection.execute(queries.followers, params)).fetchall()
        self.events = _events(heads)

    async def settle(self, settlement: _Settlement) -> None:
        queries, connection = self._queries, self._connection
        if settlement.published:
            await connection.execute(queries.published, {"ids": settlement.published})
        if settlement.failed:
            failed = settlement.failed
            params = {
                "ids": [failure.id for failure in failed],
                "errors": [failure.error for failure in failed],
                "delays": [_ms(failure.delay) for failure in failed],
                "dead": [failure.dead for failure in failed],
            }
            await connection.execute(queries.failed, params)
        if settlement.note is not None and settlement.untouched:
            params = {"ids": settlement.untouched, "error": settlement.note}
            await connection.execute(queries.noted, params)

    async def extend(self) -> None:
        pass  # the rows stay locked until the transaction ends


class _PostgresBackend:
    def __init__(self, store: Any) -> None:
        self._store = store
        self._queries = _sql.PostgresQueries(store.schema)

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[_Batch]:
        store = self._store
        # The transaction, and its locks, last until the outcomes are recorded (see _sql).
        with store._errors(_Subject()):
            pool = await store._async_pool()
            async with pool.connection() as connection, connection.transaction():
                batch = _PostgresBatch(self._queries, connection)
                await batch.load(limit)
                yield batch

    async def listen(self, wake: asyncio.Event) -> asyncio.Task[None] | None:
        return asyncio.get_running_loop().create_task(self._listen(wake), name="oncely-listen")

    async def _listen(self, wake: asyncio.Event) -> None:
        """Set *wake* on each NOTIFY, reconnecting (and waking once) after a failure."""
        import psycopg

        store = self._store
        delay = 0.1
        while True:
            try:
                connection = await psycopg.AsyncConnection.connect(store._conninfo, **store._kwargs)
                async with connection:
                    await connection.execute(f'LISTEN "{self._queries.channel}"')
                    delay = 0.1
                    wake.set()  # a notification sent before LISTEN took effect is not lost
                    async for _ in connection.notifies():
                        wake.set()
            except psycopg.Error as exc:
                logger.warning(
                    "outbox relay: LISTEN failed (%s); polling meanwhile, retrying in %.1f s",
                    exc,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def purge(self, retention: timedelta) -> int:
        from oncely.stores.postgres._sql import Statement

        store, queries = self._store, self._queries
        purged: int = 0
        while True:
            params = {"retention": retention, "batch": _PURGE_BATCH}
            reply = await store._aexecute(Statement(queries.purge, params, "the outbox"))
            purged += reply.rowcount
            if reply.rowcount < _PURGE_BATCH:
                break
        while True:
            statement = Statement(queries.purge_keys, {"batch": _PURGE_BATCH}, "the outbox")
            if (await store._aexecute(statement)).rowcount < _PURGE_BATCH:
                return purged

    async def stats(self) -> dict[str, Any]:
        from oncely.stores.postgres._sql import Statement

        statement = Statement(self._queries.stats, {}, "the outbox", resend=True)
        pending, dead, published, oldest = (await self._store._aexecute(statement)).rows[0]
        return {
            "pending": pending,
            "dead": dead,
            "published": published,
            "oldest_pending": None if oldest is None else oldest.isoformat(),
        }

    async def aclose(self) -> None:
        pass  # the store's pool is the store's


# -- SQLite ---------------------------------------------------------------------------------------


class _SQLiteBatch:
    def __init__(self, backend: _SQLiteBackend, events: list[OutboxEvent]) -> None:
        self._backend = backend
        self.events = events
        self.settled = False

    async def settle(self, settlement: _Settlement) -> None:
        await self._backend.call(self._backend.settle, settlement)
        self.settled = True

    async def extend(self) -> None:
        await self._backend.call(self._backend.extend, [event.id for event in self.events])


class _SQLiteBackend:
    """The store's transactions, run in a thread of the relay's own (SQLite is sync)."""

    def __init__(self, store: Any, claim_for: timedelta) -> None:
        self._store = store
        self._claim_ms = _ms(claim_for)
        self._executor: ThreadPoolExecutor | None = None

    async def call(self, function: Any, *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="oncely-outbox")
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _write(self) -> contextlib.AbstractContextManager[Any]:
        return sqlite_write(self._store)

    def _claim(self, limit: int) -> list[OutboxEvent]:
        with self._write() as connection:
            now = self._store.clock.now_ms()
            rows = connection.execute(_sql.SQLITE_HEADS, {"now": now, "limit": limit}).fetchall()
            scopes = _scopes(rows)
            if scopes and len(rows) < limit:
                params = {
                    "scopes": json.dumps(scopes),
                    "ids": json.dumps([row[0] for row in rows]),
                    "limit": limit - len(rows),
                }
                rows += connection.execute(_sql.SQLITE_FOLLOWERS, params).fetchall()
            if rows:
                claim = {"until": now + self._claim_ms, "ids": json.dumps([row[0] for row in rows])}
                connection.execute(_sql.SQLITE_CLAIM, claim)
        return _events(rows)

    def settle(self, settlement: _Settlement) -> None:
        with self._write() as connection:
            now = self._store.clock.now_ms()
            connection.executemany(
                _sql.SQLITE_PUBLISHED, [(now, event_id) for event_id in settlement.published]
            )
            connection.executemany(
                _sql.SQLITE_FAILED,
                [
                    (f.error, now + _ms(f.delay), now if f.dead else None, f.id)
                    for f in settlement.failed
                ],
            )
            connection.executemany(
                _sql.SQLITE_RELEASED,
                [(settlement.note, event_id) for event_id in settlement.untouched],
            )

    def extend(self, ids: list[int]) -> None:
        with self._write() as connection:
            until = self._store.clock.now_ms() + self._claim_ms
            connection.execute(_sql.SQLITE_CLAIM, {"until": until, "ids": json.dumps(ids)})

    def release(self, ids: list[int], error: str | None) -> None:
        with self._write() as connection:
            connection.executemany(_sql.SQLITE_RELEASED, [(error, event_id) for event_id in ids])

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[_Batch]:
        batch = _SQLiteBatch(self, await self.call(self._claim, limit))
        try:
            yield batch
        finally:
            if not batch.settled and batch.events:  # cancelled, or the store failed: let go
                with contextlib.suppress(Exception):
                    await self.call(self.release, [event.id for event in batch.events], None)

    async def listen(self, wake: asyncio.Event) -> asyncio.Task[None] | None:
        return None  # SQLite has no notifications: the relay polls

    def _purge(self, retention: timedelta) -> int:
        purged: int = 0
        while True:
            with self._write() as connection:
                before = self._store.clock.now_ms() - _ms(retention)
                count = connection.execute(_sql.SQLITE_PURGE, (before, _PURGE_BATCH)).rowcount
            purged += count
            if count < _PURGE_BATCH:
                break
        while True:
            with self._write() as connection:
                count = connection.execute(_sql.SQLITE_PURGE_KEYS, (_PURGE_BATCH,)).rowcount
            if count < _PURGE_BATCH:
                return purged

    async def purge(self, retention: timedelta) -> int:
        return int(await self.call(self._purge, retention))

    def _stats(self) -> dict[str, Any]:
        store = self._store
        with store._guarded(""), store._translate_errors("the outbox"):
            row = store._connection().execute(_sql.SQLITE_STATS).fetchone()
        pending, dead, published, oldest = row
        return {
            "pending": pending,
            "dead": dead,
            "published": published,
            "oldest_pending": None if oldest is None else iso_ms(oldest),
        }

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.call(self._stats)
        return result

    async def aclose(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # its connection is the store's, closed with it
            self._executor = None


@contextlib.contextmanager
def sqlite_write(store: Any) -> Iterator[Any]:
    """A write transaction on *store*'s connection of this thread; SQLite's errors as the
    store's (a missing table is `SchemaMissingError`)."""
    with store._translate_errors("the outbox"), store._transaction("the outbox") as connection:
        yield connection


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 UTC."""
    from datetime import datetime, timezone

    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def backend_stats(store: Any) -> dict[str, Any]:
    """The outbox's counts (for ``oncely outbox stats``): pending, dead, published, oldest."""
    check_store(store, "the outbox")

    async def count() -> dict[str, Any]:
        backend: _Backend = (
            _PostgresBackend(store)
            if store.backend == "postgres"
            else _SQLiteBackend(store, timedelta(0))
        )
        try:
            return await backend.stats()
        finally:
            await backend.aclose()

    return asyncio.run(count())
