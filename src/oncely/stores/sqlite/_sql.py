"""SQLite statements, one named constant each, with their parameters and what they return."""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final = 2
"""The schema version this code reads and writes (2: the ``op`` column, the outbox tables)."""

COLUMNS: Final = "SELECT name FROM pragma_table_info('oncely_records')"
"""Returns the names of the record table's columns, one per row."""

ADD_OP: Final = "ALTER TABLE oncely_records ADD COLUMN op TEXT"
"""Upgrades a version 1 table (run by `migrate` when the column is missing)."""

SELECT_VERSION: Final = "SELECT version FROM oncely_schema WHERE id = 1"
"""Returns one row with the applied schema version."""

SELECT: Final = """
SELECT key, status, fingerprint, token, attempt, lease_expires_at_ms, expires_at_ms,
       created_at_ms, updated_at_ms, result, op
  FROM oncely_records WHERE key = ?
"""
"""Parameters: key. Returns the record's row, or nothing: the record's columns, then the call
id kept with it (see `oncely.stores._machine`)."""

UPSERT: Final = """
INSERT INTO oncely_records (key, status, fingerprint, token, attempt, lease_expires_at_ms,
                            expires_at_ms, created_at_ms, updated_at_ms, result, op)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET
    status = excluded.status, fingerprint = excluded.fingerprint, token = excluded.token,
    attempt = excluded.attempt, lease_expires_at_ms = excluded.lease_expires_at_ms,
    expires_at_ms = excluded.expires_at_ms, created_at_ms = excluded.created_at_ms,
    updated_at_ms = excluded.updated_at_ms, result = excluded.result, op = excluded.op
"""
"""Parameters: every column in table order. Writes the record the state machine decided on."""

INSERT: Final = """
INSERT INTO oncely_records (key, status, fingerprint, token, attempt, lease_expires_at_ms,
                            expires_at_ms, created_at_ms, updated_at_ms, result, op)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (key) DO NOTHING
"""
"""Parameters: every column in table order. Writes the record of a key that had none, if it
still has none (one row changed), else nothing."""

SWAP: Final = """
UPDATE oncely_records
   SET status = ?, fingerprint = ?, token = ?, attempt = ?, lease_expires_at_ms = ?,
       expires_at_ms = ?, created_at_ms = ?, updated_at_ms = ?, result = ?, op = ?
 WHERE key = ? AND status = ? AND fingerprint = ? AND token = ? AND attempt = ?
   AND lease_expires_at_ms = ? AND expires_at_ms = ? AND created_at_ms = ? AND updated_at_ms = ?
   AND result IS ? AND op IS ?
"""
"""Parameters: every column but the key, as written; then the row as `SELECT` returned it.
Writes the record only if the stored row is still that one (one row changed), else nothing."""

FINISH: Final = """
UPDATE oncely_records
   SET status = ?, result = ?, lease_expires_at_ms = ?, expires_at_ms = ?, updated_at_ms = ?
 WHERE key = ? AND token = ? AND status = 'in_progress' AND expires_at_ms > ?
"""
"""Parameters: status ('completed' or 'failed'), result, now_ms (the lease's end), now_ms plus
the ttl (the record's expiry), now_ms; key, token, now_ms. `oncely._core.machine.complete` (or
``fail``) where it succeeds: one changed row means done; none, that it may not be (the state
machine decides on the record)."""

PURGE: Final = """
DELETE FROM oncely_records
 WHERE key IN (SELECT key FROM oncely_records WHERE expires_at_ms <= ? LIMIT ?)
"""
"""Parameters: now_ms, batch size. Deletes one batch of expired records (uses the index)."""

SCAN: Final = """
SELECT key, status, fingerprint, token, attempt, lease_expires_at_ms, expires_at_ms,
       created_at_ms, updated_at_ms, NULL, NULL
  FROM oncely_records WHERE key > ? AND key < ? AND expires_at_ms > ? ORDER BY key LIMIT ?
"""
"""Parameters: after (a stored key), the namespace's upper bound (see
`oncely.stores._namespace.namespace_range`), now_ms, limit. Live records of a named namespace in
key order, without their results (the two ``NULL`` columns stand for the result and the call
id, so that a row has `SELECT`'s shape)."""

SCAN_DEFAULT: Final = """
SELECT key, status, fingerprint, token, attempt, lease_expires_at_ms, expires_at_ms,
       created_at_ms, updated_at_ms, NULL, NULL
  FROM oncely_records
 WHERE key > ? AND expires_at_ms > ?
   AND (instr(key, ':') = 0 OR instr(substr(key, 1, instr(key, ':')), '|') > 0)
 ORDER BY key LIMIT ?
"""
"""Parameters: after (a stored key), now_ms, limit. `SCAN` for the default namespace: its stored
keys have no ``:`` or a ``|`` before the first one (`oncely.stores._namespace`)."""
