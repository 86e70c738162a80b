"""The hot statements sent straight to libpq: the claim and the finishes of single keys.

psycopg's cursor spends, per execution, more client time than the round trip's server work
(adapting each parameter, looking its prepared statement up, making a Column per field, loading
each timestamp into an aware datetime): the claim of a replay cost 65 µs of client CPU through
``Cursor.execute`` and 33 µs through libpq's own call, same statement, same connection. So the
statements of `claim_statement` and `finish_statement` (their text is `_sql`'s, with its
placeholders numbered) go through ``pgconn.send_query_prepared`` and psycopg's own wait (its
Ctrl-C cancellation and connection checks included), binary both ways, and their replies are
read from the raw result: a timestamp is an integer of microseconds since 2000, an integer a
big-endian one, text and bytea their bytes.

Each connection prepares each statement once, under a name of its text's hash, the first time
it runs it (one extra round trip, as psycopg's ``prepare=True``); a store made with
``prepare=False`` (behind a pooler) sends them unnamed each time. A connection whose client
encoding is not UTF-8 takes the cursor's path instead.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    Mismatch,
    Record,
    Replay,
    Status,
)
from oncely._deps import require
from oncely.errors import CorruptRecordError

if TYPE_CHECKING:
    import psycopg
    import psycopg.errors
    import psycopg.generators
else:
    psycopg = require("psycopg", extra="postgres")
    require("psycopg.generators", extra="postgres")
    require("psycopg.errors", extra="postgres")

__all__ = [
    "KINDS",
    "Wire",
    "arun",
    "checked",
    "claim_answer",
    "encoded",
    "numbered",
    "prepared_on",
    "run",
    "wires",
]

BACKEND: Final = "postgres"

_TEXT: Final = 25
_INT8: Final = 20
_BYTEA: Final = 17
_INTERVAL: Final = 1186
_OIDS: Final = {"t": _TEXT, "8": _INT8, "b": _BYTEA, "i": _INTERVAL}

_OK: Final = (psycopg.pq.ExecStatus.TUPLES_OK, psycopg.pq.ExecStatus.COMMAND_OK)
_SQLSTATE: Final = psycopg.pq.DiagnosticField.SQLSTATE
_UNDEFINED_SQLSTATE: Final = b"26000"  # invalid_sql_statement_name: deallocated behind us
_DUPLICATE_SQLSTATE: Final = b"42P05"  # duplicate_prepared_statement
_EXECUTE: Final = psycopg.generators.execute
_INTERVAL_US: Final = struct.Struct("!qii")

_EPOCH_2000_MS: Final = 946_684_800_000
"""2000-01-01 UTC, PostgreSQL's epoch, in milliseconds since 1970."""


def numbered(sql: str) -> str:
    """*sql* with psycopg's ``%s`` placeholders numbered as the server's ``$1``, ``$2``…"""
    parts = sql.split("%s")
    return "".join(
        part + (f"${index}" if index < len(parts) else "") for index, part in enumerate(parts, 1)
    )


@dataclass(frozen=True, slots=True)
class Wire:
    """A statement as libpq takes it: its text with numbered placeholders, the name it is
    prepared under, and its parameters' types (``t`` text, ``8`` bigint, ``b`` bytea, ``i``
    interval; every parameter and result goes in binary)."""

    sql: bytes
    name: bytes
    types: Sequence[int]
    formats: Sequence[int]
    encoders: Sequence[Callable[[Any], bytes]]

    @classmethod
    def of(cls, sql: str, kinds: str) -> Wire:
        text = numbered(sql).encode()
        name = b"oncely_" + hashlib.sha256(text).hexdigest()[:24].encode()
        types = [_OIDS[kind] for kind in kinds]
        return cls(text, name, types, [1] * len(kinds), [_ENCODERS[kind] for kind in kinds])


def _interval(value: timedelta) -> bytes:
    micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    return _INTERVAL_US.pack(micros, 0, 0)


_ENCODERS: Final[dict[str, Callable[[Any], bytes]]] = {
    # C callables but for the interval: no Python frame per parameter.
    "t": str.encode,
    "8": functools.partial(int.to_bytes, length=8, byteorder="big", signed=True),
    "b": bytes,
    "i": _interval,
}


KINDS: Final = {"claim": "tt88t", "claim_call": "tt88t", "complete": "tbitt8tt"}
"""The `_sql.Queries` statements that take this path, and their parameters' types (`Wire`)."""


def wires(queries: Any) -> dict[str, Wire]:
    """The `Wire` of each of *queries*' statements named in `KINDS`, by the statement's text."""
    return {
        getattr(queries, name): Wire.of(getattr(queries, name), kinds)
        for name, kinds in KINDS.items()
    }


def prepared_on(connection: Any) -> set[bytes] | None:
    """The names *connection* has prepared (none on its first statement), or ``None`` when
    it cannot take this path (a client encoding other than UTF-8)."""
    try:
        prepared: set[bytes] | None = connection._oncely_prepared
    except AttributeError:
        utf8 = connection.pgconn.parameter_status(b"client_encoding") == b"UTF8"
        prepared = connection._oncely_prepared = set() if utf8 else None
    return prepared


def encoded(wire: Wire, params: Sequence[Any]) -> list[bytes | None]:
    """*params* in *wire*'s binary formats, for a caller that sends *wire* itself (the inbox,
    in one pipeline with its savepoint)."""
    return [None if v is None else f(v) for f, v in zip(wire.encoders, params, strict=True)]


def checked(results: list[Any]) -> Any:
    """The last of *results*, or its error raised as psycopg's exception."""
    return _checked(results)


def _checked(results: list[Any]) -> Any:
    result = results[-1]
    if result.status not in _OK:
        raise psycopg.errors.error_from_result(result, encoding="utf-8")
    return result


def _prepared(results: list[Any]) -> None:
    # A name the session already has: prepared before, its answer lost to an interruption.
    result = results[-1]
    if result.status not in _OK and result.error_field(_SQLSTATE) != _DUPLICATE_SQLSTATE:
        _checked(results)


def run(
    connection: psycopg.Connection[Any],
    wire: Wire,
    params: Sequence[Any],
    prepared: set[bytes] | None,
) -> Any:
    """Run *wire* with *params* on *connection*, prepared under its name unless *prepared*
    (the names `prepared_on` the connection) is ``None``: its result (a libpq ``PGresult``)."""
    pgconn = connection.pgconn
    values = [None if v is None else f(v) for f, v in zip(wire.encoders, params, strict=True)]
    if prepared is None:
        pgconn.send_query_params(wire.sql, values, wire.types, wire.formats, 1)
        return _checked(connection.wait(_EXECUTE(pgconn)))
    for _ in range(2):
        if wire.name not in prepared:
            pgconn.send_prepare(wire.name, wire.sql, wire.types)
            _prepared(connection.wait(_EXECUTE(pgconn)))
            prepared.add(wire.name)
        pgconn.send_query_prepared(wire.name, values, wire.formats, 1)
        result = connection.wait(_EXECUTE(pgconn))[-1]
        if result.status in _OK or result.error_field(_SQLSTATE) != _UNDEFINED_SQLSTATE:
            break
        prepared.discard(wire.name)  # deallocated behind our back: prepare it again
    return _checked([result])


async def arun(
    connection: psycopg.AsyncConnection[Any],
    wire: Wire,
    params: Sequence[Any],
    prepared: set[bytes] | None,
) -> Any:
    """Async `run`."""
    pgconn = connection.pgconn
    values = [None if v is None else f(v) for f, v in zip(wire.encoders, params, strict=True)]
    if prepared is None:
        pgconn.send_query_params(wire.sql, values, wire.types, wire.formats, 1)
        return _checked(await connection.wait(_EXECUTE(pgconn)))
    for _ in range(2):
        if wire.name not in prepared:
            pgconn.send_prepare(wire.name, wire.sql, wire.types)
            _prepared(await connection.wait(_EXECUTE(pgconn)))
            prepared.add(wire.name)
        pgconn.send_query_prepared(wire.name, values, wire.formats, 1)
        result = (await connection.wait(_EXECUTE(pgconn)))[-1]
        if result.status in _OK or result.error_field(_SQLSTATE) != _UNDEFINED_SQLSTATE:
            break
        prepared.discard(wire.name)
    return _checked([result])


# -- decoding -----------------------------------------------------------------------------------


def _int(value: bytes | None) -> int:
    if value is None:
        raise TypeError("NULL is not an integer")
    return int.from_bytes(value, "big", signed=True)


def _ms(value: bytes | None) -> int:
    # A binary timestamptz: microseconds since 2000-01-01 UTC (floored to milliseconds, as
    # `_sql._epoch_ms` floors a datetime).
    return _int(value) // 1000 + _EPOCH_2000_MS


def _text(value: bytes | None) -> str:
    if value is None:
        raise TypeError("NULL is not text")
    return value.decode()


_STATUSES: Final = {status.value: status for status in Status}
_from: Final = int.from_bytes


def _record(key: str, result: Any) -> Record:
    get = result.get_value
    try:
        status = _text(get(0, 2))
        known = _STATUSES.get(status)
        if known is None:
            raise ValueError(f"{status!r} is not a valid Status")
        # Inline rather than `_int` and `_ms`: a frame less per column. A NULL raises TypeError.
        return Record(
            key=key,
            status=known,
            fingerprint=_text(get(0, 3)),
            token=_from(get(0, 4), "big", signed=True),
            attempt=_from(get(0, 5), "big", signed=True),
            lease_expires_at_ms=_from(get(0, 6), "big", signed=True) // 1000 + _EPOCH_2000_MS,
            expires_at_ms=_from(get(0, 7), "big", signed=True) // 1000 + _EPOCH_2000_MS,
            created_at_ms=_from(get(0, 8), "big", signed=True) // 1000 + _EPOCH_2000_MS,
            updated_at_ms=_from(get(0, 9), "big", signed=True) // 1000 + _EPOCH_2000_MS,
            result=get(0, 10),
        )
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(str(exc), backend=BACKEND, key=key) from exc


def claim_answer(key: str, result: Any, decided: bool) -> ClaimResult | None:
    """The answer in the claim row of *result* (`_sql.CLAIM`'s or `_sql.CLAIM_CALL`'s): one
    row, as `_sql.decode_claim` reads it, or, unless *decided* (``CLAIM_CALL``'s), ``None``
    when the row has no outcome or there is no row (`_sql.decode_claim_one`)."""
    rows = result.ntuples
    outcome = result.get_value(0, 0) if rows else None
    if not decided and outcome is None:
        return None
    if rows != 1:
        raise CorruptRecordError(f"oncely_claim returned {rows} rows", backend=BACKEND, key=key)
    get = result.get_value
    if outcome == b"acquired" or outcome == b"recovered":
        try:
            token, attempt = _int(get(0, 4)), _int(get(0, 5))
        except TypeError as exc:
            raise CorruptRecordError(str(exc), backend=BACKEND, key=key) from exc
        return Acquired(token, recovered=outcome == b"recovered", attempt=attempt)
    if outcome == b"corrupt":
        status = get(0, 2)
        shown = status.decode(errors="replace") if status is not None else None
        raise CorruptRecordError(f"unknown status {shown!r}", backend=BACKEND, key=key)
    record = _record(key, result)
    if outcome == b"replay":
        return Replay(record, judged_at_ms=_ms(get(0, 1)))
    if outcome == b"mismatch":
        return Mismatch(stored_fingerprint=record.fingerprint)
    if outcome == b"in_progress":
        # Microseconds, not the record's milliseconds (as `_sql.decode_claim`).
        return InProgress(retry_after=timedelta(microseconds=_int(get(0, 6)) - _int(get(0, 1))))
    shown = outcome.decode(errors="replace") if outcome is not None else None
    raise CorruptRecordError(f"unknown claim outcome {shown!r}", backend=BACKEND, key=key)
