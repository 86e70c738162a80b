"""The one exception boundary of the PostgreSQL store: psycopg's and psycopg_pool's exceptions
become oncely's here, and nowhere else (the store's verbs, its inbox and outbox paths alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from oncely._deps import require
from oncely.errors import (
    ConfigurationError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool
else:
    psycopg = require("psycopg", extra="postgres")
    psycopg_pool = require("psycopg_pool", extra="postgres")

__all__ = ["Boundary", "first_line", "server_message"]

BACKEND = "postgres"

SCHEMA_MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.InvalidSchemaName,
)
"""What the server says when the oncely schema is missing or older than this code."""

REFUSALS = (
    "password authentication failed",
    "authentication failed for user",
    "no password supplied",
    "no pg_hba.conf entry",
    "does not exist",  # the role or the database (FATAL at connect time: nothing else)
    "is not permitted to log in",
    "permission denied for database",
)
"""What libpq and the server say when they refuse the settings rather than fail for the moment
(a connection failure carries no SQLSTATE, so its message is all there is to go on)."""


@dataclass(frozen=True, slots=True)
class Boundary:
    """How one store's driver errors read as oncely's.

    Attributes:
        where: ``host:port/dbname``, for messages.
        schema: The store's schema, for messages.
        pool_timeout: The store's wait for a pooled connection, for messages.
    """

    where: str
    schema: str
    pool_timeout: float

    def translated(
        self, exc: BaseException, subject: str, last_error: str | None = None
    ) -> Exception | None:
        """*exc* as oncely's exception while serving *subject* (``None``: not the driver's).

        *last_error* is the reason of the pool's last failed connection, if known: it explains
        a pool timeout.
        """
        if isinstance(exc, psycopg_pool.PoolClosed):
            return StoreError("the store is closed", backend=BACKEND)
        if isinstance(exc, psycopg_pool.PoolTimeout):
            return StoreUnavailableError(
                f"no connection to PostgreSQL at {self.where} within {self.pool_timeout}s "
                f"for {subject}" + (f": {last_error}" if last_error else ""),
                backend=BACKEND,
            )
        if isinstance(exc, SCHEMA_MISSING):
            return SchemaMissingError(
                f"the oncely schema is missing or out of date in schema {self.schema!r} at "
                f"{self.where}: run store.migrate() or `oncely migrate` ({first_line(exc)})",
                backend=BACKEND,
            )
        if isinstance(exc, psycopg.OperationalError):
            return StoreUnavailableError(
                f"PostgreSQL at {self.where} could not serve {subject}: {first_line(exc)}",
                backend=BACKEND,
            )
        if isinstance(exc, psycopg.Error):
            return StoreError(
                f"PostgreSQL at {self.where} failed on {subject}: {first_line(exc)}",
                backend=BACKEND,
            )
        return None

    def unreachable(self, exc: psycopg.OperationalError) -> Exception:
        """A failed connection attempt: `ConfigurationError` if the server refused these
        settings, else `StoreUnavailableError`, quoting the driver's reason."""
        if any(refusal in str(exc) for refusal in REFUSALS):
            return ConfigurationError(
                f"PostgreSQL at {self.where} refused the store's settings: {server_message(exc)}"
            )
        return StoreUnavailableError(
            f"cannot connect to PostgreSQL at {self.where}: {server_message(exc)}",
            backend=BACKEND,
        )


def server_message(exc: BaseException) -> str:
    """The reason in a libpq connection error, without its "connection to server at" preamble."""
    text = " ".join(str(exc).split())
    return text.rsplit(" failed: ", 1)[-1]


def first_line(exc: BaseException) -> str:
    """The first line of *exc*'s message (the server's own, without its detail and hint)."""
    return str(exc).strip().split("\n", 1)[0]
