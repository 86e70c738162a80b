"""The steps of a protected operation, each a sans-I/O flow: acquire, settle, replay.

Every entry point runs these (through `oncely._execution.drivers`), or a straight line that
calls the same helpers (`oncely._execution.fast`).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from oncely import _events, _observed
from oncely._core import codec as _codec
from oncely._core.flow import Flow
from oncely._core.machine import landed
from oncely._core.policy import Policy
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Replay,
    Status,
)
from oncely._execution.lease import Lease
from oncely._execution.ops import Invoke, Sleep, StartHeartbeat, StopHeartbeat, StoreCall
from oncely._log import fields, get_logger
from oncely.errors import (
    CorruptRecordError,
    FingerprintMismatchError,
    InProgressError,
    LeaseLostError,
    ResultUnavailableError,
    StoreUnavailableError,
)

logger = get_logger("oncely")

SETTLE_RETRY_DELAYS = (0.05, 0.2, 0.5, 1.0)
"""Pauses between attempts to complete, fail or release when the store is unavailable."""


def acquire(
    key: str, fingerprint: str, policy: Policy, first: ClaimResult | None = None
) -> Flow[Lease | Replay]:
    """Claim *key*; wait or raise on a live lease as the policy says; raise on a mismatch.

    *first* is the answer to a first claim already sent (see `call`): the flow goes on from it.
    """
    deadline = time.monotonic() + policy.wait_timeout.total_seconds()
    backoff = 0.01
    answer = first
    while True:
        if answer is None:
            answer = yield StoreCall(
                "claim", (key, fingerprint), {"lease": policy.lease, "ttl": policy.ttl}
            )
        if isinstance(answer, Acquired):
            lease = acquired(key, answer, policy)
            if policy.heartbeat:
                yield StartHeartbeat(lease)
            return lease
        if isinstance(answer, Replay):
            suppressed(key, answer)
            return answer
        if isinstance(answer, Mismatch):
            if _events.on:
                _observed.claimed(key, "mismatch")
            logger.info(
                "fingerprint mismatch key=%s", key, extra=fields(key=key, outcome="mismatch")
            )
            raise FingerprintMismatchError(key)
        if not isinstance(answer, InProgress):  # pragma: no cover - a store broke the contract
            raise TypeError(f"claim answered {answer!r}")
        remaining = deadline - time.monotonic()
        if policy.on_conflict == "raise" or remaining <= 0:
            if _events.on:
                _observed.claimed(key, "in_progress")
            logger.info(
                "duplicate in progress key=%s", key, extra=fields(key=key, outcome="in_progress")
            )
            raise InProgressError(key, retry_after=answer.retry_after)
        yield Sleep(min(answer.retry_after.total_seconds(), backoff, remaining))
        backoff = min(backoff * 2, 1.0)
        answer = None


def acquired(key: str, answer: Acquired, policy: Policy) -> Lease:
    """The lease of a claim that answered *answer* (logged if it was recovered)."""
    if _events.on:
        _observed.claimed(key, answer)
    if answer.recovered:
        logger.warning(
            "lease recovered key=%s token=%d attempt=%d",
            key,
            answer.token,
            answer.attempt,
            extra=fields(key=key, token=answer.token, attempt=answer.attempt, outcome="recovered"),
        )
    return Lease(key, answer.token, policy.lease, answer.recovered, answer.attempt, ttl=policy.ttl)


def suppressed(key: str, answer: Replay) -> None:
    """Log a duplicate answered from its finished record."""
    if _events.on:
        _observed.claimed(key, answer)
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "duplicate suppressed key=%s status=%s",
            key,
            answer.record.status.value,
            extra=fields(key=key, token=answer.record.token, outcome=answer.record.status),
        )


def settle(
    lease: Lease,
    verb: str,
    payload: bytes | None,
    policy: Policy,
    first: tuple[LeaseLost | None, BaseException | None] | None = None,
) -> Flow[None]:
    """Complete, fail or release *lease*, retrying while the store is briefly unavailable.

    *first* is the outcome (answer, or the exception it raised) of a first call already sent
    (see `call`): the flow goes on from it.

    Raises:
        LeaseLostError: The lease was lost before the operation could be completed or failed.
        StoreUnavailableError: The store stayed unavailable; the key recovers after the lease.
    """
    if lease.committed:  # completed in the operation's own transaction, already committed
        if lease.heartbeat is not None:
            yield StopHeartbeat(lease)
        return
    if verb == "release":
        call = StoreCall("release", (lease.key, lease.token))
    else:  # the operation ran: a cancelled caller still records its outcome
        call = StoreCall(verb, (lease.key, lease.token, payload), {"ttl": policy.ttl}, shield=True)
    lease.settling = True
    retried = False
    try:
        for delay in (*SETTLE_RETRY_DELAYS, None):
            try:
                if first is None:
                    answer = yield call
                else:
                    (answer, error), first = first, None
                    if error is not None:
                        raise error
            except StoreUnavailableError:
                retried = True
                if delay is None:
                    logger.error(
                        "could not %s key=%s token=%d: the store is unavailable; the key "
                        "recovers after its lease",
                        verb,
                        lease.key,
                        lease.token,
                        extra=fields(key=lease.key, token=lease.token, outcome="store_unavailable"),
                    )
                    raise
                yield Sleep(delay)
            else:
                break
    finally:
        if lease.heartbeat is not None:
            yield StopHeartbeat(lease)
    if isinstance(answer, LeaseLost) and retried:
        # An earlier attempt may have been applied with its reply lost on the way back: then
        # the record already shows this token settled, and the lease was not lost at all.
        record = yield StoreCall("get", (lease.key,))
        if landed(record, lease.token, verb, payload):
            return
    if isinstance(answer, LeaseLost):
        lease.lost = True
        if _events.on:
            _observed.lease_lost(lease.key, lease.token, verb)
        logger.error(
            "lease lost key=%s token=%d on %s",
            lease.key,
            lease.token,
            verb,
            extra=fields(key=lease.key, token=lease.token, outcome="lease_lost"),
        )
        if verb != "release":
            raise LeaseLostError(lease.key, token=lease.token)


def complete_with(lease: Lease, value: Any, codec: _codec.Codec, policy: Policy) -> Flow[None]:
    """Store *value* as the outcome; a value that cannot be encoded is stored as unavailable."""
    yield from settle(lease, "complete", outcome_of(lease, value, codec), policy)


def complete_or_raise(lease: Lease, value: Any, codec: _codec.Codec, policy: Policy) -> Flow[None]:
    """`complete_with`, then `raise_if_unstorable`: for callers that are handed the value back."""
    yield from complete_with(lease, value, codec, policy)
    raise_if_unstorable(lease)


def outcome_of(lease: Lease, value: Any, codec: _codec.Codec) -> bytes:
    """*value* framed as the stored outcome, or the unavailable marker if it cannot be encoded
    (then `Lease.unstorable` says why, for `raise_if_unstorable`)."""
    try:
        return _codec.encode_value(codec.encode(value))
    except Exception as exc:
        lease.unstorable = exc
        logger.warning(
            "result of key=%s cannot be serialised (%s); it is recorded as unavailable",
            lease.key,
            exc,
            extra=fields(key=lease.key, token=lease.token, outcome="unserialisable"),
        )
        return _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")


def raise_if_unstorable(lease: Lease) -> None:
    """Tell the first caller, once the record is completed, that its value could not be stored:
    the same `ResultUnavailableError` every replay raises, so the mistake shows on the first
    call rather than on a retry in production."""
    exc = lease.unstorable
    if exc is not None:
        raise ResultUnavailableError(
            lease.key,
            f"the codec cannot store the returned value ({type(exc).__name__}: {exc}); the "
            "operation took effect once and will not run again",
        ) from exc


def settle_error(lease: Lease, exc: BaseException, policy: Policy) -> Flow[None]:
    """Store a final error, or release the lease for any other; never mask *exc*.

    Whatever settling raises (an `Exception`: a cancellation still propagates) is logged and
    chained to *exc*, which the caller sees; the lease recovers on expiry.
    """
    final = isinstance(exc, policy.final_errors)
    try:
        if final:
            yield from settle(lease, "fail", _codec.encode_error(exc), policy)
        else:
            yield from settle(lease, "release", None, policy)
    except Exception as settle_exc:
        logger.error(
            "could not record the failure of key=%s: %s",
            lease.key,
            settle_exc,
            extra=fields(key=lease.key, token=lease.token, outcome="not_recorded"),
        )
        chain(exc, settle_exc)


def chain(exc: BaseException, settle_exc: BaseException) -> None:
    """Attach *settle_exc* to *exc* (as its context when it has none, and as a note)."""
    if settle_exc is exc:
        return
    if settle_exc.__context__ is exc:  # raised while *exc* was handled: no cycle
        settle_exc.__context__ = None
    if exc.__context__ is None:
        exc.__context__ = settle_exc
    if sys.version_info >= (3, 11):
        exc.add_note(f"oncely could not record this failure: {settle_exc!r}")


def protected_call(
    key: str,
    fingerprint: str,
    policy: Policy,
    codec: _codec.Codec,
    annotation: Any,
    first: ClaimResult | None = None,
) -> Flow[Any]:
    """The whole decorated call: acquire, invoke, settle; or replay.

    `call` and `acall` run the common cases (a new key, a replay) in a straight line, and this
    flow for the others, from the first claim's answer *first*.
    """
    outcome = yield from acquire(key, fingerprint, policy, first)
    if isinstance(outcome, Replay):
        return replay(outcome, codec, annotation, policy)
    try:
        value = yield Invoke(outcome)
    except BaseException as exc:
        yield from settle_error(outcome, exc, policy)
        raise
    yield from complete_or_raise(outcome, value, codec, policy)
    return value


def replay(outcome: Replay, codec: _codec.Codec, annotation: Any, policy: Policy) -> Any:
    """Return the stored value, or raise the stored final error, of a finished operation."""
    record = outcome.record
    body = _codec.value_body(record.result) if record.status is Status.COMPLETED else None
    if body is not None:  # the common case, without decoding the outcome's frame
        return decoded(record.key, codec, body, annotation)
    try:
        stored = _codec.decode_outcome(record.result)
    except ValueError as exc:
        raise CorruptRecordError(str(exc), backend="record", key=record.key) from exc
    if stored.kind == "unavailable":
        raise ResultUnavailableError(record.key, stored.reason)
    if stored.kind == "error" or record.status is Status.FAILED:
        raise rebuild_error(record.key, stored, policy)
    return decoded(record.key, codec, stored.body, annotation)


def decoded(key: str, codec: _codec.Codec, body: bytes, annotation: Any) -> Any:
    """The stored value *body* of *key*, decoded."""
    try:
        return codec.decode(body, annotation)
    except Exception as exc:
        raise ResultUnavailableError(key, f"the stored value cannot be decoded: {exc}") from exc


def rebuild_error(key: str, stored: _codec.Outcome, policy: Policy) -> BaseException:
    """Rebuild a stored final error as its own declared type (or subclass), and only as such."""
    error = _codec.rebuild_error(stored, policy.final_errors)
    if error is not None:
        return error
    return ResultUnavailableError(
        key, f"it failed with {stored.error_type}, which is not one of the declared final errors"
    )
