-- oncely SQLite schema, version 1. Applied by SQLiteStore.migrate() (automatically on open
-- unless the store is opened with migrate=False).
CREATE TABLE IF NOT EXISTS oncely_records (
    key                 TEXT    PRIMARY KEY,
    status              TEXT    NOT NULL,
    fingerprint         TEXT    NOT NULL,
    token               INTEGER NOT NULL,
    attempt             INTEGER NOT NULL,
    lease_expires_at_ms INTEGER NOT NULL,
    expires_at_ms       INTEGER NOT NULL,
    created_at_ms       INTEGER NOT NULL,
    updated_at_ms       INTEGER NOT NULL,
    result              BLOB
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS oncely_records_expires_at ON oncely_records (expires_at_ms);

CREATE TABLE IF NOT EXISTS oncely_schema (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);

INSERT INTO oncely_schema (id, version) VALUES (1, 1)
    ON CONFLICT (id) DO UPDATE SET version = max(version, excluded.version);
