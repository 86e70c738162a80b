"""Reference semantics of the record state machine (docs/contract.md), as pure functions.

The memory and SQLite stores run these functions inside their atomic section; every other store
implements the same table in its own atomic operation and is tested against these functions.
Each function takes the record as found (or ``None``) and the store clock's time, and returns the
record to write (``None`` for "leave as is") together with the answer.

Lease and record windows for one key::

    claim ──────── lease ────────┐ extend ── lease ──┐
      │ in_progress, token t     │                   │ expired: the next claim takes over
      │                          │                   │ with token t+1 (recovered=True)
      └──────────────────── record ttl ──────────────┴──────────────────────────────┐
                                                       past it the key is absent,  │
                                                       but tokens restart only then ┘

An in-progress record outlives its lease by a margin: its expiry is at least
``lease end + max(ttl, lease)`` (`claim`, a takeover), and `extend` keeps the margin the record
had (at least the new lease) past the new lease end. So a worker whose lease lapsed keeps its
token fenced off for at least that long: the key cannot expire and restart its tokens at 1 under
a zombie, even when ``ttl <= lease`` or heartbeats carry the lease past the ttl.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Record,
    Replay,
    Status,
)

__all__ = ["SETTLED", "claim", "complete", "extend", "fail", "landed", "release"]

Transition = tuple[Record | None, LeaseLost | None]
"""A settle transition: the record to write (``None``: unchanged) and `LeaseLost` or ``None``."""


def claim(
    key: str,
    record: Record | None,
    fingerprint: str,
    *,
    now_ms: int,
    lease_ms: int,
    ttl_ms: int,
) -> tuple[Record | None, ClaimResult]:
    """Claim *key* for one worker.

    Args:
        key: The scoped key.
        record: The record as found, or ``None`` when absent.
        fingerprint: The digest of this request.
        now_ms: The store clock's time.
        lease_ms: How long the lease lasts.
        ttl_ms: How long an in-progress record is kept at least past its lease's end (so
            tokens do not restart under a worker whose lease lapsed): see `_kept_until`.

    Returns:
        The record to write (``None``: leave unchanged) and the answer for the caller.
    """
    if record is None or not record.is_live(now_ms) or record.status is Status.RELEASED:
        previous_token = record.token if record is not None else 0
        attempt = 1
        if record is not None and record.is_live(now_ms):
            # A released tombstone: the same operation is being retried.
            attempt = record.attempt + 1
        created = now_ms if attempt == 1 or record is None else record.created_at_ms
        taken = Record(
            key=key,
            status=Status.IN_PROGRESS,
            fingerprint=fingerprint,
            token=previous_token + 1,
            attempt=attempt,
            lease_expires_at_ms=now_ms + lease_ms,
            expires_at_ms=_kept_until(now_ms + lease_ms, max(ttl_ms, lease_ms)),
            created_at_ms=created,
            updated_at_ms=now_ms,
        )
        if taken.token == 1 and attempt == 1:  # a key never seen: the answer is always this
            return taken, _FIRST_LEASE
        return taken, Acquired(taken.token, recovered=False, attempt=attempt)
    if record.fingerprint != fingerprint:
        return None, Mismatch(stored_fingerprint=record.fingerprint)
    if record.status is not Status.IN_PROGRESS:
        return None, Replay(record, judged_at_ms=now_ms)
    if now_ms < record.lease_expires_at_ms:
        return None, InProgress(
            retry_after=timedelta(milliseconds=record.lease_expires_at_ms - now_ms)
        )
    taken = replace(
        record,
        token=record.token + 1,
        attempt=record.attempt + 1,
        lease_expires_at_ms=now_ms + lease_ms,
        expires_at_ms=max(
            record.expires_at_ms, _kept_until(now_ms + lease_ms, max(ttl_ms, lease_ms))
        ),
        updated_at_ms=now_ms,
    )
    return taken, Acquired(taken.token, recovered=True, attempt=taken.attempt)


_FIRST_LEASE = Acquired(1, recovered=False, attempt=1)
"""The answer to the claim of a key never seen (immutable: made once)."""


def _kept_until(lease_end_ms: int, margin_ms: int) -> int:
    """The expiry of an in-progress record whose lease ends at *lease_end_ms*.

    The record outlives its lease by *margin_ms* (``max(ttl, lease)`` for a claim), so the
    token of a worker whose lease lapsed is not handed out again while it may still be alive.
    """
    return lease_end_ms + margin_ms


def _held(record: Record | None, token: int, now_ms: int) -> bool:
    return (
        record is not None
        and record.is_live(now_ms)
        and record.status is Status.IN_PROGRESS
        and record.token == token
    )


def complete(
    record: Record | None, token: int, result: bytes, *, now_ms: int, ttl_ms: int
) -> Transition:
    """Store *result* as the outcome, if *token* still holds the lease."""
    return _finish(record, token, result, Status.COMPLETED, now_ms=now_ms, ttl_ms=ttl_ms)


def fail(
    record: Record | None, token: int, error: bytes, *, now_ms: int, ttl_ms: int
) -> Transition:
    """Store *error* as a final failure, if *token* still holds the lease."""
    return _finish(record, token, error, Status.FAILED, now_ms=now_ms, ttl_ms=ttl_ms)


def _finish(
    record: Record | None, token: int, result: bytes, status: Status, *, now_ms: int, ttl_ms: int
) -> Transition:
    if (
        record is None
        or now_ms >= record.expires_at_ms
        or record.status is not Status.IN_PROGRESS
        or record.token != token
    ):  # `_held`, written out: every complete and fail comes here
        return None, LeaseLost()
    done = Record(  # as `dataclasses.replace` would, at a fraction of its cost (every call)
        key=record.key,
        status=status,
        fingerprint=record.fingerprint,
        token=record.token,
        attempt=record.attempt,
        lease_expires_at_ms=now_ms,
        expires_at_ms=now_ms + ttl_ms,
        created_at_ms=record.created_at_ms,
        updated_at_ms=now_ms,
        result=result,
    )
    return done, None


def release(record: Record | None, token: int, *, now_ms: int) -> Transition:
    """Give the lease up; the record stays as a tombstone that keeps its token until it expires."""
    if record is None or not _held(record, token, now_ms):
        return None, LeaseLost()
    return replace(
        record, status=Status.RELEASED, lease_expires_at_ms=now_ms, updated_at_ms=now_ms
    ), None


def extend(record: Record | None, token: int, *, now_ms: int, lease_ms: int) -> Transition:
    """Move the lease's end to *lease_ms* from now, if *token* still holds it."""
    if record is None or not _held(record, token, now_ms):
        return None, LeaseLost()
    lease_end = now_ms + lease_ms
    margin = max(record.expires_at_ms - record.lease_expires_at_ms, lease_ms)
    return replace(
        record,
        lease_expires_at_ms=lease_end,
        expires_at_ms=max(record.expires_at_ms, _kept_until(lease_end, margin)),
        updated_at_ms=now_ms,
    ), None


SETTLED: dict[str, Status] = {
    "complete": Status.COMPLETED,
    "fail": Status.FAILED,
    "release": Status.RELEASED,
}
"""The status each settle verb leaves its record in."""


def landed(
    record: Record | None, token: int, verb: str | None = None, result: bytes | None = None
) -> bool:
    """Whether *record* shows a settle by the lease *token* applied: the one rule for a settle
    sent again after its reply was lost (it then answers `LeaseLost`, though it did land).

    Only the holder of *token* can settle its record, and a takeover raises the token, so a
    record that still has *token* and is no longer in progress was settled by that holder. With
    *verb*, it must show that verb's status (`SETTLED`) and, when *result* is given, that
    result byte for byte; with no verb, any settle counts.
    """
    if record is None or record.token != token:
        return False
    if verb is None:
        return record.status is not Status.IN_PROGRESS
    return record.status is SETTLED[verb] and (result is None or record.result == result)
