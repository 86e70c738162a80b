"""The claim decision, without I/O: every claim answer and the verdict it decides."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from oncely import Acquired, InProgress, Mismatch, Record, Replay, Status
from oncely.consumers import Action, ConsumerPolicy, Reason
from oncely.consumers._decision import decide, retry_delay
from oncely.errors import (
    CorruptRecordError,
    FingerprintMismatchError,
    StoreError,
    StoreUnavailableError,
)

POLICY = ConsumerPolicy(max_attempts=3, retry_delay=timedelta(seconds=2))


def record(status: Status, attempt: int = 1) -> Record:
    return Record(
        key="k",
        status=status,
        fingerprint="",
        token=1,
        attempt=attempt,
        lease_expires_at_ms=0,
        expires_at_ms=1,
        created_at_ms=0,
        updated_at_ms=0,
        result=None,
    )


def test_a_lease_within_the_attempts_runs_the_handler() -> None:
    assert decide("k", Acquired(1), POLICY) is None
    assert decide("k", Acquired(4, recovered=True, attempt=3), POLICY) is None


def test_a_lease_past_the_attempts_is_dead_lettered_as_exhausted() -> None:
    verdict = decide("k", Acquired(5, recovered=True, attempt=4), POLICY)
    assert verdict is not None
    assert (verdict.action, verdict.reason, verdict.attempt) == (
        Action.DEAD_LETTER,
        Reason.EXHAUSTED,
        4,
    )


def test_a_completed_duplicate_is_acked_with_its_first_result() -> None:
    answer = Replay(record(Status.COMPLETED))
    verdict = decide("k", answer, POLICY, lambda replay: ("decoded", replay.record.token))
    assert verdict is not None
    assert (verdict.action, verdict.reason, verdict.key) == (Action.ACK, Reason.DUPLICATE, "k")
    assert verdict.result == ("decoded", 1)


@pytest.mark.parametrize(("attempt", "reason"), [(1, Reason.HANDLER_FAILED), (3, Reason.EXHAUSTED)])
def test_a_dead_lettered_record_dead_letters_its_copy(attempt: int, reason: Reason) -> None:
    verdict = decide("k", Replay(record(Status.FAILED, attempt)), POLICY)
    assert verdict is not None
    assert (verdict.action, verdict.reason, verdict.attempt) == (
        Action.DEAD_LETTER,
        reason,
        attempt,
    )


@pytest.mark.parametrize(
    ("left", "delay"),
    [
        (timedelta(milliseconds=300), timedelta(milliseconds=300)),
        (timedelta(seconds=30), timedelta(seconds=2)),
        (timedelta(0), timedelta(seconds=2)),
    ],
)
def test_a_live_lease_elsewhere_retries_within_its_time_left(
    left: timedelta, delay: timedelta
) -> None:
    verdict = decide("k", InProgress(left), POLICY)
    assert verdict is not None
    assert (verdict.action, verdict.reason, verdict.delay) == (
        Action.RETRY,
        Reason.IN_PROGRESS,
        delay,
    )


def test_a_mismatch_and_a_corrupt_record_are_dead_lettered() -> None:
    mismatch = decide("k", Mismatch("other"), POLICY)
    assert mismatch is not None
    assert (mismatch.action, mismatch.reason) == (Action.DEAD_LETTER, Reason.MISMATCH)
    assert isinstance(mismatch.error, FingerprintMismatchError)
    assert mismatch.error.key == "k"
    error = CorruptRecordError("bad bytes", backend="t", key="k")
    corrupt = decide("k", error, POLICY)
    assert corrupt is not None
    assert (corrupt.action, corrupt.reason, corrupt.error) == (
        Action.DEAD_LETTER,
        Reason.CORRUPT_RECORD,
        error,
    )


@pytest.mark.parametrize(
    "answer",
    [StoreUnavailableError("down", backend="t"), StoreError("odd", backend="t"), "nonsense"],
)
def test_a_store_error_or_an_answer_off_the_contract_retries(answer: Any) -> None:
    verdict = decide("k", answer, POLICY)
    assert verdict is not None
    assert (verdict.action, verdict.reason, verdict.delay) == (
        Action.RETRY,
        Reason.STORE_UNAVAILABLE,
        POLICY.retry_delay,
    )
    assert isinstance(verdict.error, Exception)
    if isinstance(answer, Exception):
        assert verdict.error is answer


def test_the_retry_delay_never_outlasts_the_limit() -> None:
    assert retry_delay(POLICY) == timedelta(seconds=2)
    assert retry_delay(POLICY, timedelta(seconds=1)) == timedelta(seconds=1)
    assert retry_delay(POLICY, timedelta(seconds=-1)) == timedelta(seconds=2)
