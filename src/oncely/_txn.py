"""The caller's transaction, whatever holds it: the driver connection behind it, and checks.

The inbox and the outbox both write in the caller's own transaction, given as a psycopg 3
connection (sync or async), a standard-library ``sqlite3`` connection, a SQLAlchemy session or
connection (sync or async) over those drivers, or Django's ``django.db.connection``. This module
finds the driver's connection behind each, and refuses one without an open transaction (a write
there would commit on its own). *user* names the caller in error messages (``"the inbox"``).
"""

from __future__ import annotations

from typing import Any

from oncely.errors import ConfigurationError

__all__ = [
    "araw_connection",
    "check_psycopg_transaction",
    "check_sqlite_transaction",
    "raw_connection",
]


def raw_connection(connection: Any, user: str) -> Any:
    """The driver's connection behind a SQLAlchemy session or connection, Django's, or a
    DB-API cursor's."""
    module = type(connection).__module__
    if module.startswith("sqlalchemy"):
        get_connection = getattr(connection, "connection", None)
        if callable(get_connection):  # a Session: its Connection, in its transaction
            connection = get_connection()
        return connection.connection.driver_connection
    if module.startswith("django"):
        connection = getattr(connection, "db", connection)  # a cursor's connection
        if not connection.in_atomic_block:
            raise ConfigurationError(f"{user} needs Django's transaction.atomic() around it")
        connection.ensure_connection()
        return connection.connection
    if type(connection).__name__ in ("Cursor", "ClientCursor", "ServerCursor"):
        return connection.connection  # a psycopg or sqlite3 cursor
    return connection


async def araw_connection(connection: Any) -> Any:
    """The psycopg ``AsyncConnection`` behind a SQLAlchemy ``AsyncSession``/``AsyncConnection``
    (an await) or an async cursor, or *connection* itself."""
    if type(connection).__module__.startswith("sqlalchemy"):
        get_connection = getattr(connection, "connection", None)
        if callable(get_connection):  # an AsyncSession
            connection = await get_connection()
        connection = (await connection.get_raw_connection()).driver_connection
    elif type(connection).__name__ in ("AsyncCursor", "AsyncClientCursor"):
        connection = connection.connection
    return connection


def check_psycopg_transaction(connection: Any, user: str) -> None:
    """Refuse a psycopg connection in autocommit outside a transaction, or in a failed one."""
    # libpq's PGTransactionStatusType (psycopg.pq.TransactionStatus), read as the integer: no
    # enum lookups on every claim. 0: IDLE, 3: INERROR.
    status = connection.pgconn.transaction_status
    if status == 0 and connection.autocommit:
        raise ConfigurationError(
            f"{user} writes in the caller's transaction, and this psycopg connection has "
            "none: use `with connection.transaction():` (or a connection without autocommit)"
        )
    if status == 3:
        raise ConfigurationError("the caller's transaction has failed: roll it back first")


def check_sqlite_transaction(connection: Any, user: str) -> None:
    """Refuse a sqlite3 connection outside a transaction."""
    if not getattr(connection, "in_transaction", False):
        raise ConfigurationError(
            f"{user} writes in the caller's transaction, and this sqlite3 connection has "
            "none: run BEGIN IMMEDIATE first (or write something in the transaction)"
        )
