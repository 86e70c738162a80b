"""Transactional inbox: an operation's record written in the caller's own database transaction.

When an operation's effect is writes to the database that holds its idempotency record, the
record can be written in the same transaction as the effect. Then a crash at any instant leaves
either both or neither: no lease window, no ambiguous commit.

.. code-block:: python

    inbox = oncely.Inbox(store)          # a PostgreSQL or SQLite store: the same table

    with connection.transaction():       # the application's own transaction (psycopg)
        with inbox.claim(connection, order_id, scope="orders.create", fingerprint=body) as entry:
            if entry.replayed:
                return entry.result      # committed by an earlier transaction
            connection.execute("INSERT INTO orders ...")
            entry.complete({"order_id": order_id})

How it behaves, seen from one transaction:

* The first transaction to **commit** a key wins. The claim is a row written in the caller's
  transaction, invisible to others until it commits, already completed by then.
* A concurrent duplicate **waits** (up to ``wait_timeout``; ``on_conflict="raise"`` answers at
  once) for the first to finish: if it committed, the duplicate replays its result; if it
  rolled back, the duplicate runs.
* The same key with another fingerprint raises `FingerprintMismatchError`.
* A key claimed with a lease elsewhere (`oncely.idempotent`, the HTTP middleware, a consumer)
  is respected: while that lease is live the inbox answers `InProgressError`.
* The block's own writes and the record go together: if the block raises, both are rolled back
  to a savepoint taken at the claim, and the exception propagates. oncely never commits or rolls
  back the caller's transaction itself.
* An exception of ``final_errors`` is an outcome, as for `oncely.idempotent`: the block's writes
  are undone, the error is recorded in the caller's transaction (kept if it commits), and a
  replay raises it again.

On PostgreSQL a claim is one round trip (the savepoint and the claim, with its bounded wait, in
one pipeline) and its completion another. `Inbox.idempotent` is the decorator form, for
functions that are given the connection or session.

Connections: psycopg 3 (`psycopg.Connection`; `psycopg.AsyncConnection` with `aclaim`), the
standard library's `sqlite3.Connection` (in a transaction that holds the write lock: ``BEGIN
IMMEDIATE``, or after a write), SQLAlchemy ``Session``/``Connection`` (and their async forms
with `aclaim`) over those drivers, and Django's ``django.db.connection`` inside
``transaction.atomic()``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar

from oncely import _events, _execution, _observed, _switches, _txn
from oncely._core import codec as _codec
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import digest
from oncely._core.flow import Flow, adrive, drive
from oncely._core.keys import scope_key, validate_key
from oncely._core.policy import UNSET, Duration, Policy, _Unset, derive
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Replay,
    Status,
)
from oncely._log import fields
from oncely.decorator import (
    _ALL,
    _IMPLICIT,
    KeyFunc,
    _AllArguments,
    _CallPlan,
    _check_result_type,
    _is_async,
    default_scope,
)
from oncely.errors import (
    ConfigurationError,
    FingerprintMismatchError,
    InProgressError,
    LeaseLostError,
    OncelyError,
)

__all__ = ["AsyncInboxEntry", "Inbox", "InboxEntry", "current_transaction"]

P = ParamSpec("P")
R = TypeVar("R")
H = TypeVar("H", bound=Callable[..., Any])

logger = logging.getLogger("oncely")

_TRANSACTION: contextvars.ContextVar[Any] = contextvars.ContextVar("oncely_transaction")
"""The connection or session of the `Inbox.transactional` handler running in this context."""

_CONNECTION_NAMES = ("connection", "conn", "session", "cursor")
"""The parameters `Inbox.idempotent` looks for the connection in, in this order."""

_SAVEPOINT = "oncely_inbox"
_USER = "the inbox"
_BLOCK_SAVEPOINT = "oncely_inbox_block"
"""Taken after the claim when the policy has final errors: such an error undoes the block's
writes back to it, and keeps the claim to record the error on."""
_BUSY_HINT = timedelta(seconds=1)
"""`InProgressError.retry_after` when another transaction holds the key: a short hint."""


class Inbox:
    """Record idempotency keys in the caller's own transaction, next to its writes.

    Args:
        store: The `PostgresStore` or `SQLiteStore` whose table holds the records (the same
            database the caller's connection writes to). Records are shared with every other
            entry point using that store: one ``migrate()``, one CLI, one purge.
        policy: The base `Policy`; the keyword arguments below override single fields of it.
        ttl: How long a committed outcome is replayed.
        on_conflict: For a duplicate whose first transaction has not finished: ``"wait"``
            (the default here, bounded by ``wait_timeout``) then replay or run; or ``"raise"``
            `InProgressError` at once.
        wait_timeout: The bound on waiting.
        final_errors: Exception types that are outcomes, as for `oncely.idempotent`: raised in
            the block, they undo its writes and are recorded (in the caller's transaction) in
            place of a result; replays raise them again. Any other exception undoes the claim
            too, so that a retry runs.
        codec: Serialises the value given to `InboxEntry.complete` (JSON by default).

    Raises:
        ConfigurationError: The store keeps its records in no SQL database.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: Any,
        *,
        policy: Policy | None = None,
        ttl: Duration | _Unset = UNSET,
        on_conflict: Literal["raise", "wait"] = "wait",
        wait_timeout: Duration | _Unset = UNSET,
        final_errors: tuple[type[BaseException], ...] | _Unset = UNSET,
        codec: Codec | None = None,
    ) -> None:
        backend = getattr(store, "backend", None)
        if backend not in ("postgres", "sqlite"):
            raise ConfigurationError(
                f"the inbox writes records in the caller's SQL transaction: it needs a "
                f"PostgresStore or an SQLiteStore, not {type(store).__name__}"
            )
        self.store = store
        self.policy = derive(
            policy,
            ttl=ttl,
            on_conflict=on_conflict,
            wait_timeout=wait_timeout,
            final_errors=final_errors,
            heartbeat=False,
        )
        self.codec: Codec = codec or JSONCodec()
        self._scripts: _PostgresScripts | None = None

    def _postgres_scripts(self) -> _PostgresScripts:
        """The store's statements, rendered once."""
        if self._scripts is None:
            self._scripts = _PostgresScripts(self.store)
        return self._scripts

    def claim(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> InboxEntry:
        """Claim *key* (within *scope*) in *connection*'s open transaction: a ``with`` block.

        Args:
            connection: The caller's connection or session, inside its transaction.
            key: The idempotency key; validated before it touches the database.
            scope: The operation's name; the same key in two scopes names two operations.
            fingerprint: What the operation was asked to do (any canonicalisable value), or
                ``None`` to skip the check.
        """
        plan = self._plan(key, scope, fingerprint)
        return InboxEntry(self, plan, _sync_performer(self, connection))

    def aclaim(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> AsyncInboxEntry:
        """`claim` for an async connection or session: an ``async with`` block."""
        plan = self._plan(key, scope, fingerprint)
        return AsyncInboxEntry(self, plan, _AsyncPerformer(self, connection))

    def idempotent(
        self,
        *,
        key: str | KeyFunc,
        scope: str | None = None,
        fingerprint: Sequence[str] | Callable[..., Any] | _AllArguments | None = _ALL,
        connection: str | Callable[..., Any] | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorate a function that writes through a connection or session it is given, so
        that it takes effect once per key, its record written in that connection's transaction.

        .. code-block:: python

            @inbox.idempotent(key="order_id")
            def place_order(conn, order_id: str, cents: int) -> dict:
                conn.execute("INSERT INTO orders VALUES (%s, %s)", (order_id, cents))
                return {"order": order_id}

            with conn.transaction():
                place_order(conn, "o-1", 500)   # runs; a repeat returns the stored result

        The caller opens and ends the transaction, as with `claim`. A final error (see
        ``final_errors``) is recorded in it and raised; it is kept only if the caller commits.

        Args:
            key: As for `oncely.idempotent`: the name of the parameter holding the key, or a
                callable over the function's arguments returning it.
            scope: The key's namespace (default: the function's module and qualified name).
            fingerprint: As for `oncely.idempotent`: by default every argument but the
                connection (and ``self``, ``cls``); a list of names; a callable; or ``None``.
            connection: The parameter holding the connection, session or cursor, or a callable
                over the arguments returning it. By default the first parameter named
                ``connection``, ``conn``, ``session`` or ``cursor``.

        Raises:
            ConfigurationError: At decoration time, for a parameter the function does not have,
                or none that holds a connection.
        """
        if not (isinstance(key, str) or callable(key)):
            raise ConfigurationError(f"key must be a parameter name or a callable, not {key!r}")
        if isinstance(fingerprint, str):
            raise ConfigurationError("fingerprint takes a list of parameter names, not a string")

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            wrapped: Callable[P, R] = _decorate(self, fn, key, scope, fingerprint, connection)
            return wrapped

        return decorate

    def transactional(self, begin: Callable[[], Any]) -> Callable[[H], H]:
        """Decorate a consumer's handler so that its writes and its message's record commit
        together, in one transaction that *begin* opens: the ack follows the commit.

        .. code-block:: python

            inbox = oncely.Inbox(store)            # the store the consumer records in

            @rabbitmq.idempotent_handler(store, group="billing")
            @inbox.transactional(pool.connection)  # psycopg_pool.AsyncConnectionPool
            async def on_order(message) -> None:
                connection = oncely.current_transaction()
                await connection.execute("INSERT INTO charges ...")

        The consumer claims the message with a lease, as always (its attempts are counted and
        a message that keeps failing is dead-lettered). The handler then runs inside the
        transaction, and the record is completed in that same transaction, by the lease's
        fencing token, before it commits. A worker that dies before the commit leaves neither
        the writes nor the completion (the message is redelivered and runs again once the
        lease is over); one that dies after it leaves both (the redelivery is a duplicate,
        acked without running). A worker that outlived its lease, and was overtaken, finds its
        token fenced out: its transaction rolls back, and only one run ever commits.

        It works the same under `oncely.idempotent` and a `Guard`: any protected operation
        whose effect is writes in the store's database.

        Args:
            begin: Called once per message, it returns a context manager (an async one for an
                async handler) that opens a transaction, gives the connection or session to
                write through (psycopg, SQLAlchemy, sqlite3 or Django's, as for `claim`), and
                commits on a clean exit, rolling back on an exception: a psycopg pool's
                ``connection``, SQLAlchemy's ``engine.begin`` or ``sessionmaker.begin``. The
                handler gets it from `current_transaction`.

        The record keeps the result the handler returns, encoded with this inbox's codec, for
        as long as the consumer's ``ttl`` says.
        """

        def decorate(handler: H) -> H:
            if not callable(handler):
                raise ConfigurationError(f"transactional decorates handlers, not {handler!r}")
            if _is_async(handler):

                @functools.wraps(handler)
                async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                    lease = None if _switches.disabled else _running_lease()
                    opened = begin()
                    if not hasattr(opened, "__aenter__"):
                        raise ConfigurationError(
                            "an async handler's begin() must return an async context manager "
                            f"(async psycopg or SQLAlchemy), not {type(opened).__name__}"
                        )
                    async with opened as connection:
                        # checked before the handler: its writes would otherwise commit alone
                        perform = await _AsyncPerformer(self, connection).bind()
                        reset = _TRANSACTION.set(connection)
                        try:
                            value = await handler(*args, **kwargs)
                        finally:
                            _TRANSACTION.reset(reset)
                        if lease is None:  # disabled: the caller warned, nothing is written
                            return value
                        _committing(lease, await perform(self._settle(lease, value)))
                    lease.committed = True
                    return value

                return async_wrapper  # type: ignore[return-value]

            @functools.wraps(handler)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                lease = None if _switches.disabled else _running_lease()
                opened = begin()
                if not hasattr(opened, "__enter__"):
                    raise ConfigurationError(
                        f"begin() must return a context manager, not {type(opened).__name__}"
                    )
                with opened as connection:
                    # checked before the handler: its writes would otherwise commit alone
                    perform = _sync_performer(self, connection)
                    reset = _TRANSACTION.set(connection)
                    try:
                        value = handler(*args, **kwargs)
                    finally:
                        _TRANSACTION.reset(reset)
                    if lease is None:  # disabled: the caller warned, nothing is written
                        return value
                    _committing(lease, perform(self._settle(lease, value)))
                lease.committed = True
                return value

            return wrapper  # type: ignore[return-value]

        return decorate

    def _settle(self, lease: _execution.Lease, value: Any) -> _Settle:
        lease.settling = True  # a heartbeat's extend after this completion means nothing
        payload = _execution.outcome_of(lease, value, self.codec)
        return _Settle(lease.key, lease.token, payload, lease.ttl or self.policy.ttl)

    def _plan(self, key: str, scope: str, fingerprint: Any) -> _Plan:
        if not isinstance(scope, str) or not scope:
            raise ConfigurationError("the inbox needs a scope naming the operation")
        scoped = scope_key(scope, validate_key(key))
        return _Plan(scoped, "" if fingerprint is None else digest([fingerprint]))


@dataclass(frozen=True, slots=True)
class _Plan:
    key: str
    fingerprint: str


def current_transaction() -> Any:
    """Return the connection or session of the `Inbox.transactional` handler running now: the
    transaction its message's record is written in.

    Raises:
        ConfigurationError: No transactional handler is running in this context.

    .. versionadded:: 0.1.0
    """
    connection = _TRANSACTION.get(None)
    if connection is None:
        raise ConfigurationError(
            "current_transaction() is for handlers decorated with Inbox.transactional"
        )
    return connection


def _running_lease() -> _execution.Lease:
    lease = _execution.CURRENT.get()
    if lease is None:
        raise ConfigurationError(
            "an Inbox.transactional handler runs under an oncely consumer (or oncely.idempotent "
            "or a Guard), which claims its key with a lease first"
        )
    return lease


def _committing(lease: _execution.Lease, answer: Any) -> None:
    """Raise, inside the transaction (so that it rolls back), if the completion was refused."""
    if isinstance(answer, LeaseLost):
        lease.lost = True
        logger.error(
            "lease lost key=%s token=%d on a transactional completion: rolled back",
            lease.key,
            lease.token,
            extra=fields(key=lease.key, token=lease.token, outcome="lease_lost"),
        )
        raise LeaseLostError(lease.key, token=lease.token)


def _decorate(
    inbox: Inbox,
    fn: Callable[..., Any],
    key: str | KeyFunc,
    scope: str | None,
    fingerprint: Sequence[str] | Callable[..., Any] | _AllArguments | None,
    connection: str | Callable[..., Any] | None,
) -> Any:
    """`Inbox.idempotent` applied to *fn*: the decorator's call plan, the inbox's entry."""
    if not callable(fn):
        raise ConfigurationError(f"@inbox.idempotent decorates functions, not {fn!r}")
    _check_result_type(fn, inbox.codec)
    signature = inspect.signature(fn)
    parameters = list(signature.parameters)
    if connection is None:
        found = [name for name in _CONNECTION_NAMES if name in parameters]
        if not found:
            raise ConfigurationError(
                f"{fn.__qualname__}() has no parameter named {' or '.join(_CONNECTION_NAMES)}: "
                "name the one holding the connection with connection=..."
            )
        connection = found[0]
    named = [name for name in (key, connection) if isinstance(name, str)]
    if isinstance(fingerprint, (list, tuple)):
        named += fingerprint
    for name in named:
        if name not in parameters:
            raise ConfigurationError(
                f"{fn.__qualname__}() has no parameter {name!r} "
                f"(parameters: {', '.join(parameters)})"
            )
    if fingerprint is _ALL:  # every argument but the connection: it differs on every call
        fingerprint = [name for name in parameters if name not in _IMPLICIT and name != connection]
    plan = _CallPlan(
        fn=fn,
        store=inbox.store,
        signature=signature,
        scope=scope or default_scope(fn),
        key=key,
        fingerprint=fingerprint,
        policy=inbox.policy,
        codec=inbox.codec,
    )
    get_connection = connection

    def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Plan, Any]:
        _, key, fingerprint, *_ = plan.invocation(args, kwargs, None)
        arguments = plan.arguments(args, kwargs)
        if isinstance(get_connection, str):
            handle = arguments[get_connection]
        else:
            positional, named = plan.call_arguments(arguments)
            handle = get_connection(*positional, **named)
        return _Plan(key, fingerprint), handle

    if _is_async(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            claim, handle = prepare(args, kwargs)
            performer = _AsyncPerformer(inbox, handle)
            async with AsyncInboxEntry(inbox, claim, performer, plan.annotation) as entry:
                if entry.replayed:
                    return entry.result
                value = await fn(*args, **kwargs)
                entry.complete(value)
            return value

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        claim, handle = prepare(args, kwargs)
        performer = _sync_performer(inbox, handle)
        with InboxEntry(inbox, claim, performer, plan.annotation) as entry:
            if entry.replayed:
                return entry.result
            value = fn(*args, **kwargs)
            entry.complete(value)
        return value

    return wrapper


# -- the flow, once for sync and async ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Begin:
    """Take a savepoint and claim. An `Acquired` answer keeps the savepoint open (and takes
    the block's savepoint after the claim, if *nested*); any other answer (`InProgress` also
    when the wait for another transaction timed out) drops it."""

    key: str
    fingerprint: str
    lease: timedelta
    ttl: timedelta
    wait: timedelta
    nested: bool


@dataclass(frozen=True, slots=True)
class _Finish:
    """Settle the record in the transaction (as *status*: completed, or failed with a final
    error, after undoing the block back to its savepoint when *undo_block*), then drop the
    savepoint; answers `LeaseLost` (after rolling back to the savepoint) or ``None``."""

    key: str
    token: int
    status: Status
    result: bytes
    ttl: timedelta
    undo_block: bool = False


@dataclass(frozen=True, slots=True)
class _Settle:
    """Complete a record claimed with a lease (a consumer's), by its token, in the caller's
    transaction; answers `LeaseLost` (the transaction must then roll back) or ``None``."""

    key: str
    token: int
    result: bytes
    ttl: timedelta


@dataclass(frozen=True, slots=True)
class _Rollback:
    """Undo everything since the savepoint (the claim and the block's writes), drop it."""


def _enter(inbox: Inbox, plan: _Plan) -> Flow[Acquired | Replay]:
    policy = inbox.policy
    deadline = time.monotonic() + policy.wait_timeout.total_seconds()
    while True:
        wait = timedelta(0)
        if policy.on_conflict == "wait":
            wait = timedelta(seconds=max(deadline - time.monotonic(), 0))
        answer: ClaimResult = yield _Begin(
            plan.key, plan.fingerprint, policy.lease, policy.ttl, wait, bool(policy.final_errors)
        )
        if isinstance(answer, (Acquired, Replay)):
            return answer
        if isinstance(answer, Mismatch):
            raise FingerprintMismatchError(plan.key)
        remaining = deadline - time.monotonic()
        if policy.on_conflict == "raise" or remaining <= 0:
            raise InProgressError(plan.key, retry_after=min(answer.retry_after, _BUSY_HINT))
        # A lease held elsewhere (a transaction is waited for inside the claim itself).
        yield _execution.Sleep(min(answer.retry_after.total_seconds(), 0.05, remaining))


def _exit(
    inbox: Inbox, plan: _Plan, token: int, value: Any, error: BaseException | None
) -> Flow[None]:
    """Record the block's outcome, as the decorator does: a value, or a final error (which
    still propagates: whatever recording it raises is chained to it, never masking it)."""
    policy = inbox.policy
    if error is None:
        try:
            payload = _codec.encode_value(inbox.codec.encode(value))
        except Exception as exc:  # ran, but cannot be stored: replays fail loudly, never re-run
            payload = _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")
        finish = _Finish(plan.key, token, Status.COMPLETED, payload, policy.ttl)
    elif isinstance(error, policy.final_errors):
        payload = _codec.encode_error(error)
        finish = _Finish(plan.key, token, Status.FAILED, payload, policy.ttl, undo_block=True)
    else:
        yield _Rollback()
        return
    try:
        answer = yield finish
        if isinstance(answer, LeaseLost):  # the row is ours until commit: only a foreign writer
            raise LeaseLostError(plan.key, token=token)
    except Exception as exc:
        if error is None:
            raise
        _execution.chain(error, exc)


_UNPROTECTED = Acquired(token=0)
"""The claim of an entry under ``ONCELY_DISABLED``: held, never written."""


class _EntryState:
    """What the sync and async entries share: the plan, the claim's answer, the result."""

    def __init__(self, inbox: Inbox, plan: _Plan, annotation: Any = Any) -> None:
        self._inbox = inbox
        self._plan = plan
        self._annotation = annotation
        self._acquired: Acquired | None = None
        self._replay: Replay | None = None
        self._value: Any = None

    @property
    def key(self) -> str:
        """The scoped key."""
        return self._plan.key

    @property
    def replayed(self) -> bool:
        """True when an earlier transaction committed this operation: use `result`."""
        return self._replay is not None

    @property
    def result(self) -> Any:
        """The committed outcome of the earlier transaction.

        Raises:
            OncelyError: This entry did not replay (it holds the claim).
            Exception: The final error the earlier transaction recorded, rebuilt as its type
                (one of ``final_errors``; any other stored error is `ResultUnavailableError`).
        """
        if self._replay is None:
            raise OncelyError("this entry holds the claim: there is no stored result to replay")
        return _execution.replay(
            self._replay, self._inbox.codec, self._annotation, self._inbox.policy
        )

    @property
    def token(self) -> int:
        """The fencing token of the claim."""
        if self._acquired is None:
            raise OncelyError("this entry replayed: it holds no claim")
        return self._acquired.token

    def complete(self, value: Any = None) -> None:
        """Set the outcome written when the block ends (``None`` if never called)."""
        if self._acquired is None:
            raise OncelyError("this entry replayed: there is nothing to complete")
        self._value = value

    def _unprotected(self) -> bool:
        """Under ``ONCELY_DISABLED`` (or `oncely.testing.disabled`): the block runs, nothing
        is read or written, and a warning says so."""
        if not _switches.disabled:
            return False
        _switches.warn_unprotected(self._plan.key, key=self._plan.key)
        self._acquired = _UNPROTECTED
        return True

    def _entered(self, outcome: Acquired | Replay) -> None:
        if isinstance(outcome, Replay):
            self._replay = outcome
        else:
            self._acquired = outcome

    def _exit_flow(self, error: BaseException | None) -> Flow[None] | None:
        if self._acquired is None or self._acquired is _UNPROTECTED:
            return None  # replayed (nothing was written, the savepoint is gone), or disabled
        return _exit(self._inbox, self._plan, self._acquired.token, self._value, error)


class InboxEntry(_EntryState):
    """One claim in the caller's transaction (from `Inbox.claim`): a ``with`` block.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self, inbox: Inbox, plan: _Plan, perform: Callable[[Any], Any], annotation: Any = Any
    ) -> None:
        super().__init__(inbox, plan, annotation)
        self._perform = perform

    def __enter__(self) -> InboxEntry:
        if self._unprotected():
            return self
        flow = _enter(self._inbox, self._plan)
        if _events.on:
            flow = _observed.entering(self, flow, "inbox", self._plan.key, self._inbox.store)
        self._entered(drive(flow, self._perform))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if _events.on:
            _observed.exited(self, exc)
        flow = self._exit_flow(exc)
        if flow is not None:
            drive(flow, self._perform)


class AsyncInboxEntry(_EntryState):
    """One claim in the caller's async transaction (from `Inbox.aclaim`): ``async with``.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self, inbox: Inbox, plan: _Plan, performer: _AsyncPerformer, annotation: Any = Any
    ) -> None:
        super().__init__(inbox, plan, annotation)
        self._performer = performer

    async def __aenter__(self) -> AsyncInboxEntry:
        if self._unprotected():
            return self
        perform = await self._performer.bind()
        flow = _enter(self._inbox, self._plan)
        if _events.on:
            flow = _observed.entering(self, flow, "inbox", self._plan.key, self._inbox.store)
        self._entered(await adrive(flow, perform))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if _events.on:
            _observed.exited(self, exc)
        flow = self._exit_flow(exc)
        if flow is not None:
            await adrive(flow, await self._performer.bind())


# -- drivers: what each operation is on each kind of connection ---------------------------------


def _sync_performer(inbox: Inbox, connection: Any) -> Callable[[Any], Any]:
    raw = _raw_connection(connection)
    if inbox.store.backend == "postgres":
        return _PostgresPerformer(inbox, raw).perform
    return _SQLitePerformer(inbox.store, raw).perform


def _raw_connection(connection: Any) -> Any:
    return _txn.raw_connection(connection, _USER)


_araw_connection = _txn.araw_connection


def _check_psycopg_transaction(connection: Any) -> None:
    _txn.check_psycopg_transaction(connection, _USER)


_LEASE_LOST = "oncely: the inbox record was changed in this transaction"
"""The text of the error a guarded finish raises when it updated no row (see `_guarded`)."""

_CLAIM = """
WITH wait AS MATERIALIZED (
    SELECT previous, set_config('lock_timeout', %(wait_ms)s, true)
      FROM (SELECT current_setting('lock_timeout') AS previous OFFSET 0) AS saved
), inserted AS (
    INSERT INTO {schema}.oncely_records AS r
           (key, status, fingerprint, token, attempt, lease_expires_at, expires_at, created_at,
            updated_at, result, op)
    SELECT %(key)s, 'in_progress', %(fingerprint)s, 1, 1,
           statement_timestamp() + %(lease_ms)s::bigint * interval '1 millisecond',
           statement_timestamp() + (%(lease_ms)s::bigint
               + greatest(%(ttl_ms)s::bigint, %(lease_ms)s::bigint)) * interval '1 millisecond',
           statement_timestamp(), statement_timestamp(), NULL, %(op)s
      FROM wait
    ON CONFLICT (key) DO NOTHING
    RETURNING r.*
)
SELECT 'acquired'::text, statement_timestamp(), i.status, i.fingerprint, i.token, i.attempt,
       i.lease_expires_at, i.expires_at, i.created_at, i.updated_at, i.result,
       set_config('lock_timeout', wait.previous, true)
  FROM inserted AS i, wait
UNION ALL
SELECT c.*, set_config('lock_timeout', wait.previous, true)
  FROM wait, {schema}.oncely_claim(%(key)s, %(fingerprint)s, %(lease_ms)s::bigint,
                                   %(ttl_ms)s::bigint, %(op)s::text) AS c
 WHERE NOT EXISTS (SELECT FROM inserted)
"""
"""The claim, bounded by a ``lock_timeout`` of *wait_ms* set for it alone, in one statement.

A key never seen is one INSERT (the common case in the inbox: the row that ``oncely_claim``
would insert, as schema.sql writes it); only a key that has a row runs ``oncely_claim``, whose
reads then see that row. The INSERT waits for a transaction holding the key: if it commits, the
claim function judges its record; if it rolls back, the INSERT goes ahead. The data flow orders
the rest: the timeout is set (``wait``) before the INSERT reads its row from it, and the
caller's is restored as each answer row is produced. Parameters: those of `_sql.CLAIM`, and
wait_ms; the reply is `_sql.CLAIM`'s with the restored setting as a last column."""


def _guarded(update: str) -> str:
    """*update* made to fail when it changes no row, so that the savepoint release sent after
    it in the same round trip does not run (and the block can still be rolled back).

    The cast is of a value known only at run time: PostgreSQL cannot fold it while planning.
    """
    return (
        f"WITH done AS ({update.strip()} RETURNING 1)\n"
        f"SELECT CASE count(*) WHEN 1 THEN 1 ELSE ('{_LEASE_LOST} ' || count(*))::int END "
        f"FROM done"
    )


_Script = list[tuple[str, Any]]
"""Statements and their parameters, sent in one round trip (pipeline mode)."""


class _PostgresScripts:
    """Each operation on PostgreSQL as one script of statements, sent by the sync and async
    performers in one round trip (pipeline mode, so each statement can be prepared)."""

    def __init__(self, store: Any) -> None:
        from oncely.stores.postgres import _sql

        self.sql = _sql
        self.store = store
        queries = store._queries
        self.rollback: _Script = [
            (f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}", None),
            (f"RELEASE SAVEPOINT {_SAVEPOINT}", None),
        ]
        self.release: _Script = [(f"RELEASE SAVEPOINT {_SAVEPOINT}", None)]
        self._claim = _CLAIM.format(schema=_sql.quote_identifier(queries.schema))
        self._complete = _guarded(queries.complete)

    def begin(self, op: _Begin) -> _Script:
        """The savepoint, the claim, then the block's savepoint: the claim's reply is the
        second. A rollback to the savepoint undoes the claim's ``SET LOCAL`` too."""
        store, sql = self.store, self.sql
        params = {
            "key": store._stored_key(op.key),
            "fingerprint": op.fingerprint,
            "lease_ms": sql.ms(op.lease),
            "ttl_ms": sql.ms(op.ttl),
            "op": sql.call_id(),
            "wait_ms": str(max(int(op.wait.total_seconds() * 1000), 1)),
        }
        script: _Script = [(f"SAVEPOINT {_SAVEPOINT}", None), (self._claim, params)]
        if op.nested:
            script.append((f"SAVEPOINT {_BLOCK_SAVEPOINT}", None))
        return script

    def claimed(self, op: _Begin, replies: list[Any]) -> ClaimResult:
        reply = replies[1]
        rows = [row[:-1] for row in reply.rows]  # without the restored lock_timeout
        return self.sql.decode_claim(op.key, self.sql.Reply(rows, reply.rowcount))

    def completion(self, op: _Finish | _Settle) -> tuple[str, Any]:
        """The guarded update that writes *op*'s outcome (see `_guarded`)."""
        store = self.store
        status = op.status if type(op) is _Finish else Status.COMPLETED
        statement = self.sql.finish_statement(
            store._queries, store._stored_key(op.key), op.key, op.token, status, op.result, op.ttl
        )
        return self._complete, statement.params

    def finish(self, op: _Finish) -> _Script:
        """Write the outcome and release the savepoint; a final error first undoes the block."""
        script: _Script = [self.completion(op), *self.release]
        if op.undo_block:
            script.insert(0, (f"ROLLBACK TO SAVEPOINT {_BLOCK_SAVEPOINT}", None))
        return script

    def flow(self, op: _Begin | _Finish | _Settle | _Rollback) -> Flow[Any]:
        """Perform *op* as scripts (yielded, answered with their replies): sync and async."""
        if type(op) is _Settle:
            try:
                yield [self.completion(op)]
            except Exception as exc:
                if not _is_lease_lost(exc):
                    raise
                return LeaseLost()  # the transaction has failed: the caller rolls it back
            return None
        if type(op) is _Begin:
            try:
                answer = self.claimed(op, (yield self.begin(op)))
            except Exception as exc:
                if not _is_lock_timeout(exc):
                    raise  # the caller's driver error, in the caller's transaction
                yield self.rollback  # another transaction still holds the key
                return InProgress(retry_after=_BUSY_HINT)
            if not isinstance(answer, Acquired):
                yield self.release  # nothing was written
            return answer
        if type(op) is _Finish:
            try:
                yield self.finish(op)
            except Exception as exc:
                with contextlib.suppress(Exception):  # give the caller its transaction back
                    yield self.rollback
                if not _is_lease_lost(exc):
                    raise
                return LeaseLost()
            return None
        yield self.rollback
        return None


def _is_lock_timeout(exc: BaseException) -> bool:
    return getattr(exc, "sqlstate", None) == "55P03"  # lock_not_available


def _is_lease_lost(exc: BaseException) -> bool:
    return getattr(exc, "sqlstate", None) == "22P02" and _LEASE_LOST in str(exc)


def _pipelines() -> bool:
    """Whether the libpq psycopg uses has pipeline mode (libpq 14 and later)."""
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


class _PostgresPerformer:
    def __init__(self, inbox: Inbox, connection: Any) -> None:
        _check_psycopg_transaction(connection)
        self._scripts = inbox._postgres_scripts()
        self._connection = connection
        self._pipeline = _pipelines()

    def _run(self, script: _Script) -> list[Any]:
        """Send *script* (one round trip in pipeline mode); each statement's reply, in order."""
        from psycopg import Cursor
        from psycopg.rows import tuple_row

        connection, reply = self._connection, self._scripts.sql.Reply
        # Server-side binding whatever the connection's cursor factory (Django's binds on the
        # client): the statements are prepared after a few uses.
        cursors = [Cursor(connection, row_factory=tuple_row) for _ in script]
        with connection.pipeline() if self._pipeline else contextlib.nullcontext():
            for cursor, (sql, params) in zip(cursors, script, strict=True):
                cursor.execute(sql, params)
        return [
            reply(cursor.fetchall() if cursor.description is not None else [], cursor.rowcount)
            for cursor in cursors
        ]

    def perform(self, op: Any) -> Any:
        if type(op) is _execution.Sleep:
            return time.sleep(op.seconds)
        return drive(self._scripts.flow(op), self._run)


class _AsyncPerformer:
    """Async psycopg, directly or behind SQLAlchemy's ``AsyncSession`` / ``AsyncConnection``."""

    def __init__(self, inbox: Inbox, connection: Any) -> None:
        if inbox.store.backend != "postgres":
            raise ConfigurationError("aclaim needs PostgreSQL (async psycopg): SQLite is sync")
        self._scripts = inbox._postgres_scripts()
        self._connection = connection
        self._raw: Any = None
        self._pipeline = _pipelines()

    async def bind(self) -> Callable[[Any], Awaitable[Any]]:
        """Find the driver connection (an await for SQLAlchemy); return the performer."""
        if self._raw is None:
            self._raw = await _araw_connection(self._connection)
            _check_psycopg_transaction(self._raw)
        return self.perform

    async def _run(self, script: _Script) -> list[Any]:
        from psycopg import AsyncCursor
        from psycopg.rows import tuple_row

        connection, reply = self._raw, self._scripts.sql.Reply
        cursors = [AsyncCursor(connection, row_factory=tuple_row) for _ in script]
        async with connection.pipeline() if self._pipeline else contextlib.nullcontext():
            for cursor, (sql, params) in zip(cursors, script, strict=True):
                await cursor.execute(sql, params)
        return [
            reply(
                await cursor.fetchall() if cursor.description is not None else [], cursor.rowcount
            )
            for cursor in cursors
        ]

    async def perform(self, op: Any) -> Any:
        if type(op) is _execution.Sleep:
            return await asyncio.sleep(op.seconds)
        return await adrive(self._scripts.flow(op), self._run)


class _SQLitePerformer:
    def __init__(self, store: Any, connection: Any) -> None:
        _txn.check_sqlite_transaction(connection, _USER)
        self._store = store
        self._connection = connection

    def perform(self, op: Any) -> Any:
        from oncely._core import machine
        from oncely.stores._machine import _claim_step, _ms

        connection, store = self._connection, self._store
        kind = type(op)
        if kind is _Begin:
            stored = store._stored_key(op.key)
            step = _claim_step(stored, op.fingerprint, _ms(op.lease), _ms(op.ttl))
            connection.execute(f"SAVEPOINT {_SAVEPOINT}")
            with store._translate_errors(op.key):
                # SQLite has one writer at a time: the caller's transaction holds the write
                # lock, so the record read here cannot change before this transaction ends.
                answer = store._apply(connection, stored, step, store.clock.now_ms())
            if not isinstance(answer, Acquired):
                connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            elif op.nested:
                connection.execute(f"SAVEPOINT {_BLOCK_SAVEPOINT}")
            return store._unscoped(answer)
        if kind is _Settle:
            return self._finish(op.key, op.token, machine.complete, op.result, op.ttl)
        if kind is _Finish:
            if op.undo_block:
                connection.execute(f"ROLLBACK TO SAVEPOINT {_BLOCK_SAVEPOINT}")
            settle = machine.complete if op.status is Status.COMPLETED else machine.fail
            finished = self._finish(op.key, op.token, settle, op.result, op.ttl)
            if isinstance(finished, LeaseLost):
                connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return finished
        if kind is _Rollback:
            connection.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            connection.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return None
        if kind is _execution.Sleep:
            time.sleep(op.seconds)
            return None
        raise TypeError(f"cannot perform {op!r}")

    def _finish(
        self, key: str, token: int, settle: Callable[..., Any], result: bytes, ttl: timedelta
    ) -> Any:
        """Settle *key*'s record by *token* in the caller's transaction (the write lock held)."""
        from oncely.stores._machine import _keeping_op, _ms

        store, payload, ttl_ms = self._store, bytes(result), _ms(ttl)

        def finish(record: Any, now_ms: int) -> Any:
            return settle(record, token, payload, now_ms=now_ms, ttl_ms=ttl_ms)

        with store._translate_errors(key):
            return store._apply(
                self._connection, store._stored_key(key), _keeping_op(finish), store.clock.now_ms()
            )
