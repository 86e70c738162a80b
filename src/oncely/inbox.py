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

`Inbox.transaction` is the form for an operation that is the whole transaction: the inbox opens
it on an idle connection, claims in it, and ends it with the block (committed, or rolled back
when the block raises; a final error recorded and committed). On PostgreSQL its BEGIN goes with
the claim and its COMMIT with the outcome, with no savepoint: the fastest form.

On PostgreSQL a claim is one round trip (the savepoint and the claim, with its bounded wait, in
one query; a new key's record is written complete at once, the transaction hiding it until
commit); recording a value is one UPDATE more, and a replay or a block that records nothing
needs none. Each backend's SQL lives behind `oncely._inbox_store`. `Inbox.idempotent` is the
decorator form, for functions that are given the connection or session.

Connections: psycopg 3 (`psycopg.Connection`; `psycopg.AsyncConnection` with `aclaim`), the
standard library's `sqlite3.Connection` (in a transaction that holds the write lock: ``BEGIN
IMMEDIATE``, or after a write), SQLAlchemy ``Session``/``Connection`` (and their async forms
with `aclaim`) over those drivers, and Django's ``django.db.connection`` inside
``transaction.atomic()``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar

from oncely import _events, _execution, _inbox_flow, _inbox_store, _observed, _switches
from oncely._core import codec as _codec
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import digest
from oncely._core.flow import adrive, drive
from oncely._core.keys import scope_key, validate_key
from oncely._core.policy import UNSET, Duration, Policy, _Unset, derive
from oncely._core.records import LeaseLost
from oncely._inbox_entry import _asleep, _EntryState, _sleeping
from oncely._inbox_store import Settle
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
from oncely.errors import ConfigurationError, LeaseLostError

__all__ = ["AsyncInboxEntry", "Inbox", "InboxEntry", "current_transaction"]

P = ParamSpec("P")
R = TypeVar("R")
H = TypeVar("H", bound=Callable[..., Any])

logger = logging.getLogger("oncely")

_TRANSACTION: contextvars.ContextVar[Any] = contextvars.ContextVar("oncely_transaction")
"""The connection or session of the `Inbox.transactional` handler running in this context."""

_CONNECTION_NAMES = ("connection", "conn", "session", "cursor")
"""The parameters `Inbox.idempotent` looks for the connection in, in this order."""


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
        if not _inbox_store.supported(store):
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
        self._driver = _inbox_store.driver_for(store)
        self._none = _codec.encode_value(self.codec.encode(None))
        """The outcome of a block that records none: written with the claim, and the outcome
        it then finishes with (encoded once)."""

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
        return InboxEntry(self, plan, _sleeping(self._driver.bind(connection)))

    def aclaim(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> AsyncInboxEntry:
        """`claim` for an async connection or session: an ``async with`` block."""
        plan = self._plan(key, scope, fingerprint)
        return AsyncInboxEntry(self, plan, connection)

    def transaction(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> InboxEntry:
        """Open a transaction on *connection* and claim *key* (within *scope*) in it: a
        ``with`` block whose writes and record commit together when it ends.

        The fastest form on PostgreSQL: the transaction's BEGIN and the claim go in one round
        trip, the outcome and the COMMIT in one more. The entry behaves as `claim`'s; the
        transaction is the inbox's: committed on a clean exit (a replay's too), or with a final
        error recorded in place of the block's writes; rolled back when the block raises any
        other exception (which propagates). A COMMIT that fails raises the driver's error.

        .. code-block:: python

            with inbox.transaction(connection, order_id, scope="orders.create") as entry:
                if entry.replayed:
                    return entry.result
                connection.execute("INSERT INTO orders ...")
                entry.complete({"order_id": order_id})

        Args:
            connection: A psycopg ``Connection`` in no transaction (autocommit or not), or a
                ``sqlite3.Connection`` in none (the transaction is ``BEGIN IMMEDIATE``).
            key: The idempotency key; validated before it touches the database.
            scope: The operation's name, as for `claim`.
            fingerprint: What the operation was asked to do, as for `claim`.

        Raises:
            ConfigurationError: The connection is in a transaction already, in psycopg's
                pipeline mode, or a SQLAlchemy or Django one: use `claim` in the transaction.

        .. versionadded:: 0.1.0
        """
        plan = self._plan(key, scope, fingerprint)
        perform = _sleeping(self._driver.bind(connection, True))
        return InboxEntry(self, plan, perform, own=True)

    def atransaction(
        self, connection: Any, key: str, *, scope: str, fingerprint: Any = None
    ) -> AsyncInboxEntry:
        """`transaction` for a psycopg ``AsyncConnection``: an ``async with`` block."""
        plan = self._plan(key, scope, fingerprint)
        return AsyncInboxEntry(self, plan, connection, own=True)

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
                        perform = await self._driver.abind(connection)
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
                    perform = self._driver.bind(connection)
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

    def _settle(self, lease: _execution.Lease, value: Any) -> Settle:
        lease.settling = True  # a heartbeat's extend after this completion means nothing
        payload = _execution.outcome_of(lease, value, self.codec)
        return Settle(lease.key, lease.token, payload, lease.ttl or self.policy.ttl)

    def _plan(self, key: str, scope: str, fingerprint: Any) -> _inbox_flow.Plan:
        if not isinstance(scope, str) or not scope:
            raise ConfigurationError("the inbox needs a scope naming the operation")
        scoped = scope_key(scope, validate_key(key))
        return _inbox_flow.Plan(scoped, "" if fingerprint is None else digest([fingerprint]))


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

    def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_inbox_flow.Plan, Any]:
        _, key, fingerprint, *_ = plan.invocation(args, kwargs, None)
        arguments = plan.arguments(args, kwargs)
        if isinstance(get_connection, str):
            handle = arguments[get_connection]
        else:
            positional, named = plan.call_arguments(arguments)
            handle = get_connection(*positional, **named)
        return _inbox_flow.Plan(key, fingerprint), handle

    if _is_async(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            claim, handle = prepare(args, kwargs)
            async with AsyncInboxEntry(inbox, claim, handle, plan.annotation) as entry:
                if entry.replayed:
                    return entry.result
                value = await fn(*args, **kwargs)
                entry.complete(value)
            return value

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        claim, handle = prepare(args, kwargs)
        perform = _sleeping(inbox._driver.bind(handle))
        with InboxEntry(inbox, claim, perform, plan.annotation) as entry:
            if entry.replayed:
                return entry.result
            value = fn(*args, **kwargs)
            entry.complete(value)
        return value

    return wrapper


class InboxEntry(_EntryState):
    """One claim in the caller's transaction (from `Inbox.claim`), or in the transaction the
    inbox opens (from `Inbox.transaction`): a ``with`` block.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        inbox: Inbox,
        plan: _inbox_flow.Plan,
        perform: Callable[[Any], Any],
        annotation: Any = Any,
        own: bool = False,
    ) -> None:
        super().__init__(inbox, plan, annotation, own)
        self._perform = perform

    def __enter__(self) -> InboxEntry:
        flow = self._enter_flow()
        if flow is not None:
            answer = drive(flow, self._perform)
            if answer is not None:
                self._entered(answer)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        flow = self._exit_flow(exc)
        try:
            if flow is not None:
                drive(flow, self._perform)
        except BaseException as failed:  # not done: its outcome is not reported as one
            if _events.on:
                _observed.exited(self, failed)
            raise
        if _events.on:
            _observed.exited(self, exc)


class AsyncInboxEntry(_EntryState):
    """One claim in the caller's async transaction (from `Inbox.aclaim`): ``async with``.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        inbox: Inbox,
        plan: _inbox_flow.Plan,
        connection: Any,
        annotation: Any = Any,
        own: bool = False,
    ) -> None:
        super().__init__(inbox, plan, annotation, own)
        self._connection = connection
        self._perform: Callable[[Any], Awaitable[Any]] | None = None

    async def _bound(self) -> Callable[[Any], Awaitable[Any]]:
        if self._perform is None:
            bound = await self._inbox._driver.abind(self._connection, self._own)
            self._perform = functools.partial(_asleep, bound)
        return self._perform

    async def __aenter__(self) -> AsyncInboxEntry:
        if _switches.disabled and not self._own:
            self._unprotected()
            return self
        perform = await self._bound()
        flow = self._enter_flow()
        if flow is not None:
            answer = await adrive(flow, perform)
            if answer is not None:
                self._entered(answer)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        flow = self._exit_flow(exc)
        try:
            if flow is not None:
                await adrive(flow, await self._bound())
        except BaseException as failed:  # not done: its outcome is not reported as one
            if _events.on:
                _observed.exited(self, failed)
            raise
        if _events.on:
            _observed.exited(self, exc)
