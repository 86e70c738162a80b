-- oncely SQLite schema, version 2. Applied by SQLiteStore.migrate() (automatically on open
-- unless the store is opened with migrate=False). Version 2 adds "op", the call id of the
-- batch claim that took the lease, so that the same claim sent again finds its own lease:
-- migrate() adds it to a version 1 table (ALTER TABLE oncely_records ADD COLUMN op TEXT).
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
    result              BLOB,
    op                  TEXT
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS oncely_records_expires_at ON oncely_records (expires_at_ms);

CREATE TABLE IF NOT EXISTS oncely_schema (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);

INSERT INTO oncely_schema (id, version) VALUES (1, 2)
    ON CONFLICT (id) DO UPDATE SET version = max(version, excluded.version);
