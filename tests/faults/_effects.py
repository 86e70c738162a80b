"""Fenced effects in PostgreSQL: the writes the protected handlers make, judged by their token.

A schema of the run's own holds ``fence(key, token)``, the highest token announced for a key,
and ``effects(key, op, token, accepted)``, one row per write attempt. A run first announces its
token (`begin`: raises the fence, and tells whether an earlier run's write already stands, which
the handler then adopts instead of writing again: the downstream's own idempotency), then
writes (`write`): a single statement that is accepted only if the token is still >= the fence.
A zombie whose lease was taken over is behind the new owner's fence, so its late write is
rejected; a stale token that was handed out twice is not, and the checker sees two writes.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

_BEGIN = """
WITH previous AS (SELECT token FROM {fence} WHERE key = %(key)s),
raised AS (
    INSERT INTO {fence} (key, token) VALUES (%(key)s, %(token)s)
    ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token WHERE {fence}.token <= EXCLUDED.token
    RETURNING token
)
SELECT EXISTS (SELECT 1 FROM raised),
       (SELECT op FROM {effects} WHERE key = %(key)s AND accepted ORDER BY id LIMIT 1),
       (SELECT token FROM {effects} WHERE key = %(key)s AND accepted ORDER BY id LIMIT 1)
"""

_WRITE = """
WITH raised AS (
    INSERT INTO {fence} (key, token) VALUES (%(key)s, %(token)s)
    ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token WHERE {fence}.token <= EXCLUDED.token
    RETURNING token
)
INSERT INTO {effects} (key, op, token, accepted)
SELECT %(key)s, %(op)s, %(token)s, EXISTS (SELECT 1 FROM raised)
RETURNING accepted
"""


class Fenced(Exception):
    """The write's token is behind the fence: a newer lease holder exists."""


class Effects:
    """The fence and effects tables in *schema* of the database at *url*."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        names = {
            "fence": sql.Identifier(schema, "fence"),
            "effects": sql.Identifier(schema, "effects"),
        }
        self._begin = sql.SQL(_BEGIN).format(**names)
        self._write = sql.SQL(_WRITE).format(**names)
        self._names = names

    def create(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
            conn.execute(
                sql.SQL("CREATE TABLE {} (key text PRIMARY KEY, token bigint NOT NULL)").format(
                    self._names["fence"]
                )
            )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id bigserial PRIMARY KEY, key text NOT NULL,"
                    " op text NOT NULL, token bigint NOT NULL, accepted boolean NOT NULL)"
                ).format(self._names["effects"])
            )

    def drop(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
            )

    def rows(self, keys: list[str] | None = None) -> list[dict[str, Any]]:
        query = sql.SQL("SELECT key, op, token, accepted FROM {} ").format(self._names["effects"])
        with psycopg.connect(self.url) as conn:
            if keys is None:
                found = conn.execute(query + sql.SQL("ORDER BY id")).fetchall()
            else:
                found = conn.execute(
                    query + sql.SQL("WHERE key = ANY(%s) ORDER BY id"), (keys,)
                ).fetchall()
        return [{"key": k, "op": o, "token": t, "accepted": a} for k, o, t, a in found]

    # -- the handler's side (one connection per worker) -----------------------------------------

    def begin(self, conn: psycopg.Connection[Any], key: str, token: int) -> tuple[str, int] | None:
        """Announce *token* for *key*; return the write that already stands, if any.

        Raises:
            Fenced: A newer token was announced.
        """
        row = conn.execute(self._begin, {"key": key, "token": token}).fetchone()
        return _begun(row, key, token)

    def write(self, conn: psycopg.Connection[Any], key: str, op: str, token: int) -> bool:
        """Write *op*'s effect under *token*; return whether it was accepted."""
        row = conn.execute(self._write, {"key": key, "op": op, "token": token}).fetchone()
        return bool(row and row[0])

    async def abegin(
        self, conn: psycopg.AsyncConnection[Any], key: str, token: int
    ) -> tuple[str, int] | None:
        """Async `begin`."""
        cursor = await conn.execute(self._begin, {"key": key, "token": token})
        return _begun(await cursor.fetchone(), key, token)

    async def awrite(
        self, conn: psycopg.AsyncConnection[Any], key: str, op: str, token: int
    ) -> bool:
        """Async `write`."""
        cursor = await conn.execute(self._write, {"key": key, "op": op, "token": token})
        row = await cursor.fetchone()
        return bool(row and row[0])


def _begun(row: Any, key: str, token: int) -> tuple[str, int] | None:
    raised, op, written = row
    if not raised:
        raise Fenced(f"token {token} for {key} is behind the fence")
    return None if op is None else (str(op), int(written))
