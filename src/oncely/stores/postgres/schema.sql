-- oncely PostgreSQL schema, version 3.
--
-- Applied by PostgresStore.migrate() (or `oncely migrate`), never silently on first use. The
-- store runs this script in one transaction, under an advisory lock, with search_path set to
-- the store's schema, so it is idempotent and safe to run from several processes at once, and
-- it upgrades a schema of an earlier version in place, keeping its records.
--
-- Version 2 adds the "op" column and oncely_claim's p_op: every transition carries an id of its
-- own call and writes it to the record, so a call re-sent after its reply was lost (the
-- connection died after the commit) finds its own effect and answers as the first send did.
-- It also keeps an in-progress record max(ttl, lease) past the end of its lease.
--
-- Version 3 adds the transactional outbox: oncely_outbox and oncely_outbox_keys (below).
CREATE TABLE IF NOT EXISTS oncely_records (
    -- "C" collation: byte order, so one namespace's keys are contiguous for scans.
    key              text COLLATE "C" PRIMARY KEY,
    -- Deliberately no CHECK on status: a record this version cannot read (a newer status, a
    -- foreign writer) must reach the reader and fail closed as CorruptRecordError.
    status           text        NOT NULL,
    fingerprint      text        NOT NULL,
    token            bigint      NOT NULL,
    attempt          integer     NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    result           bytea,
    -- The id of the call that last wrote the record (a claim's, suffixed '+' for a takeover).
    op               text
);

ALTER TABLE oncely_records ADD COLUMN IF NOT EXISTS op text;  -- version 1 had none

CREATE INDEX IF NOT EXISTS oncely_records_expires_at ON oncely_records (expires_at);

CREATE TABLE IF NOT EXISTS oncely_schema (
    id      integer PRIMARY KEY CHECK (id = 1),
    version integer NOT NULL
);

DO $$
BEGIN
    IF (SELECT version FROM oncely_schema WHERE id = 1) > 3 THEN
        RAISE EXCEPTION 'the oncely schema is at a newer version than this oncely (3): upgrade oncely'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
END
$$;

-- claim: the whole claim row of the state machine (docs/contract.md) in one call, judged by
-- the server clock.
--
-- A single SQL statement cannot do this race-free under READ COMMITTED: a row inserted by a
-- concurrent claimer after the statement's snapshot is invisible to its reads, and INSERT ...
-- ON CONFLICT DO UPDATE ... WHERE returns nothing when the WHERE is false. In a function, each
-- statement takes a fresh snapshot, so a lost insert race is followed by a read that sees the
-- winner's row. Replays, live leases and mismatches are answered by the first, lock-free read;
-- a decision that writes is taken again on the row locked FOR UPDATE.
--
-- p_op is the id of this call: a claim re-sent after its reply was lost finds the in-progress
-- record it wrote (op = p_op, or p_op || '+' after a takeover) and answers as it did. An
-- in-progress record expires max(ttl, lease) past the end of its lease, so its token outlives a
-- worker whose lease lapsed (tokens restart at 1 only once the record is gone).
--
-- outcome: 'acquired' | 'recovered' (a takeover of an expired lease) | 'in_progress' | 'replay'
--          | 'mismatch' | 'corrupt' (a status this version does not know: nothing is written).
-- judged_at: the server time the decision was taken at (retry_after = lease_expires_at - it).
-- result is returned for 'replay' only.
CREATE OR REPLACE FUNCTION oncely_claim(
    p_key text, p_fingerprint text, p_lease_ms bigint, p_ttl_ms bigint, p_op text,
    OUT outcome text, OUT judged_at timestamptz, OUT status text, OUT fingerprint text,
    OUT token bigint, OUT attempt integer, OUT lease_expires_at timestamptz,
    OUT expires_at timestamptz, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT result bytea)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    lease  constant interval := p_lease_ms * interval '1 millisecond';
    margin constant interval := greatest(p_ttl_ms, p_lease_ms) * interval '1 millisecond';
    rec    oncely_records;
    locked boolean := false;
    t      timestamptz;
BEGIN
    FOR i IN 1..100 LOOP
        IF locked THEN
            SELECT * INTO rec FROM oncely_records WHERE key = p_key FOR UPDATE;
        ELSE
            SELECT * INTO rec FROM oncely_records WHERE key = p_key;
        END IF;
        t := clock_timestamp();
        outcome := NULL;
        IF NOT FOUND THEN
            INSERT INTO oncely_records AS r
                   (key, status, fingerprint, token, attempt, lease_expires_at, expires_at,
                    created_at, updated_at, result, op)
            VALUES (p_key, 'in_progress', p_fingerprint, 1, 1, t + lease,
                    t + lease + margin, t, t, NULL, p_op)
            ON CONFLICT (key) DO NOTHING
            RETURNING r.* INTO rec;
            IF FOUND THEN
                outcome := 'acquired';
            END IF;
            -- Otherwise a concurrent claimer inserted first and has committed: read its row.
        ELSIF rec.status NOT IN ('in_progress', 'completed', 'failed', 'released') THEN
            outcome := 'corrupt';
        ELSIF rec.expires_at > t AND rec.status = 'in_progress'
              AND rec.fingerprint = p_fingerprint AND rec.op = p_op THEN
            outcome := 'acquired';  -- this very call ran already: answer as it did
        ELSIF rec.expires_at > t AND rec.status = 'in_progress'
              AND rec.fingerprint = p_fingerprint AND rec.op = p_op || '+' THEN
            outcome := 'recovered';
        ELSIF rec.expires_at > t AND rec.status <> 'released' THEN
            IF rec.fingerprint <> p_fingerprint THEN
                outcome := 'mismatch';
            ELSIF rec.status <> 'in_progress' THEN
                outcome := 'replay';
            ELSIF rec.lease_expires_at > t THEN
                outcome := 'in_progress';
            ELSIF locked THEN
                UPDATE oncely_records AS r
                   SET token = r.token + 1,
                       attempt = r.attempt + 1,
                       lease_expires_at = t + lease,
                       expires_at = greatest(r.expires_at, t + lease + margin),
                       updated_at = t,
                       op = p_op || '+'
                 WHERE r.key = p_key
                RETURNING r.* INTO rec;
                outcome := 'recovered';
            END IF;
        ELSIF locked THEN
            -- Past its expiry, or a released tombstone: acquired afresh, the token kept growing.
            UPDATE oncely_records AS r
               SET status = 'in_progress',
                   fingerprint = p_fingerprint,
                   token = r.token + 1,
                   attempt = CASE WHEN r.expires_at > t THEN r.attempt + 1 ELSE 1 END,
                   lease_expires_at = t + lease,
                   expires_at = t + lease + margin,
                   created_at = CASE WHEN r.expires_at > t THEN r.created_at ELSE t END,
                   updated_at = t,
                   result = NULL,
                   op = p_op
             WHERE r.key = p_key
            RETURNING r.* INTO rec;
            outcome := 'acquired';
        END IF;
        IF outcome IS NOT NULL THEN
            judged_at := t;
            status := rec.status;
            fingerprint := rec.fingerprint;
            token := rec.token;
            attempt := rec.attempt;
            lease_expires_at := rec.lease_expires_at;
            expires_at := rec.expires_at;
            created_at := rec.created_at;
            updated_at := rec.updated_at;
            result := CASE WHEN outcome = 'replay' THEN rec.result END;
            RETURN;
        END IF;
        -- A write is due: decide again on the latest version of the row, locked.
        locked := true;
    END LOOP;
    RAISE EXCEPTION 'oncely_claim(%): no decision after 100 passes', p_key
        USING ERRCODE = 'serialization_failure';
END
$$;

-- The transactional outbox (oncely.Outbox writes, oncely.outbox.Relay publishes).
--
-- seq numbers the events of one ordering_key in commit order. It comes from the key's counter
-- row in oncely_outbox_keys, incremented by the writer's transaction, whose row lock makes the
-- next writer of that key wait until this one commits or rolls back: so a visible event of seq
-- n means every event of its key with a lower seq committed before it (see
-- oncely/stores/postgres/_outbox.py for how the relay uses that).
CREATE TABLE IF NOT EXISTS oncely_outbox (
    id              bigint      GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    message_id      text        NOT NULL UNIQUE,
    destination     text        NOT NULL,
    ordering_key    text COLLATE "C",
    seq             bigint,
    payload         bytea       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT statement_timestamp(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT statement_timestamp(),
    published_at    timestamptz,
    dead_at         timestamptz,
    last_error      text,
    CHECK ((ordering_key IS NULL) = (seq IS NULL))
);

-- Pending events: in id order for the relay's scan, and by (key, seq) for its "no earlier
-- pending event of this key" test. Both are partial, so published rows cost them nothing.
CREATE INDEX IF NOT EXISTS oncely_outbox_pending ON oncely_outbox (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE UNIQUE INDEX IF NOT EXISTS oncely_outbox_pending_key ON oncely_outbox (ordering_key, seq)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;
-- Order is kept per (ordering_key, destination): the relay finds each pair's head here.
CREATE INDEX IF NOT EXISTS oncely_outbox_pending_scope
    ON oncely_outbox (ordering_key, destination, seq)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS oncely_outbox_published ON oncely_outbox (published_at)
    WHERE published_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS oncely_outbox_keys (
    ordering_key text COLLATE "C" PRIMARY KEY,
    seq          bigint NOT NULL
);

INSERT INTO oncely_schema (id, version) VALUES (1, 3)
    ON CONFLICT (id) DO UPDATE SET version = greatest(oncely_schema.version, excluded.version);
