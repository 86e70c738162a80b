-- oncely SQLite schema, version 2. Applied by SQLiteStore.migrate() (automatically on open
-- unless the store is opened with migrate=False). Version 2 adds the transactional outbox and "op", the call id of the
-- batch claim that took the lease, so that the same claim sent again finds its own lease:
-- migrate() adds it to a version 1 table (ALTER TABLE oncely_records ADD COLUMN op TEXT).
-- No statement or comment may hold a semicolon but at its end: migrate() splits on them.
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

-- The transactional outbox. SQLite has one writer at a time, so the writer's transaction
-- holds the write lock from its first write to its commit: seq, from the key's counter row,
-- follows commit order. Times are epoch milliseconds. claimed_until_ms is a relay's claim on a
-- batch it is publishing (another relay may take the batch over once it has passed).
CREATE TABLE IF NOT EXISTS oncely_outbox (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id         TEXT    NOT NULL UNIQUE,
    destination        TEXT    NOT NULL,
    ordering_key       TEXT,
    seq                INTEGER,
    payload            BLOB    NOT NULL,
    headers            TEXT    NOT NULL DEFAULT '{}',
    created_at_ms      INTEGER NOT NULL,
    attempts           INTEGER NOT NULL DEFAULT 0,
    next_attempt_at_ms INTEGER NOT NULL,
    published_at_ms    INTEGER,
    dead_at_ms         INTEGER,
    last_error         TEXT,
    claimed_until_ms   INTEGER
);

CREATE INDEX IF NOT EXISTS oncely_outbox_pending ON oncely_outbox (id)
    WHERE published_at_ms IS NULL AND dead_at_ms IS NULL;

CREATE UNIQUE INDEX IF NOT EXISTS oncely_outbox_pending_key ON oncely_outbox (ordering_key, seq)
    WHERE published_at_ms IS NULL AND dead_at_ms IS NULL AND ordering_key IS NOT NULL;

-- Order is kept per (ordering_key, destination): the relay finds each pair's head here.
CREATE INDEX IF NOT EXISTS oncely_outbox_pending_scope
    ON oncely_outbox (ordering_key, destination, seq)
    WHERE published_at_ms IS NULL AND dead_at_ms IS NULL AND ordering_key IS NOT NULL;

CREATE INDEX IF NOT EXISTS oncely_outbox_published ON oncely_outbox (published_at_ms)
    WHERE published_at_ms IS NOT NULL;

CREATE TABLE IF NOT EXISTS oncely_outbox_keys (
    ordering_key TEXT    PRIMARY KEY,
    seq          INTEGER NOT NULL
) WITHOUT ROWID;

INSERT INTO oncely_schema (id, version) VALUES (1, 2)
    ON CONFLICT (id) DO UPDATE SET version = max(version, excluded.version);
