"""The claim decision: what a claim's answer means for a delivery, decided in one place.

Every path of the consumer (the flow of one delivery, a batch, the grouped async path) sends a
claim and hands its answer here: `decide` is pure (no I/O, no clock, no logging) and says
whether the handler runs or what the broker is told; `report` logs that decision.

==============================================  ============================================
claim answered                                  decision
==============================================  ============================================
`Acquired`, attempt within ``max_attempts``     run the handler under the lease
`Acquired`, attempt past ``max_attempts``       DEAD_LETTER (exhausted); the lease given back
`Replay` of a completed record                  ACK as a duplicate (its result decoded)
`Replay` of a failed (dead-lettered) record     DEAD_LETTER again
`InProgress`                                    RETRY after ``retry_delay`` (or the lease left)
`Mismatch`                                      DEAD_LETTER (a producer bug)
`CorruptRecordError`                            DEAD_LETTER
any other error, or an answer off the contract  RETRY after ``retry_delay``
==============================================  ============================================
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from oncely._core.records import Acquired, InProgress, Mismatch, Replay, Status
from oncely._log import fields, get_logger
from oncely.consumers._verdicts import Action, ConsumerPolicy, Reason, Verdict
from oncely.errors import CorruptRecordError, FingerprintMismatchError

__all__ = ["decide", "report", "retry_delay"]

logger = get_logger(__name__)


def retry_delay(policy: ConsumerPolicy, limit: timedelta | None = None) -> timedelta:
    """The policy's retry delay, never longer than *limit* (a lease's time left) when given."""
    delay = policy.retry_delay
    return min(delay, limit) if limit is not None and limit > timedelta(0) else delay


def decide(
    key: str,
    answer: object,
    policy: ConsumerPolicy,
    replayed: Callable[[Replay], Any] = lambda _: None,
) -> Verdict | None:
    """The verdict that the claim *answer* of *key* decides, or ``None``: run the handler.

    *answer* is what the claim answered, or the exception it raised. An `Acquired` answer with
    a verdict (started more than ``max_attempts`` times) must have its lease given back.
    *replayed* decodes what a completed duplicate's first run returned.
    """
    if isinstance(answer, Acquired):
        if answer.attempt > policy.max_attempts:
            return Verdict(Action.DEAD_LETTER, Reason.EXHAUSTED, key, attempt=answer.attempt)
        return None
    if isinstance(answer, Replay):
        record = answer.record
        if record.status is Status.FAILED:
            exhausted = record.attempt >= policy.max_attempts
            reason = Reason.EXHAUSTED if exhausted else Reason.HANDLER_FAILED
            return Verdict(Action.DEAD_LETTER, reason, key, attempt=record.attempt)
        return Verdict(Action.ACK, Reason.DUPLICATE, key, result=replayed(answer))
    if isinstance(answer, InProgress):
        return Verdict(
            Action.RETRY, Reason.IN_PROGRESS, key, retry_delay(policy, answer.retry_after)
        )
    if isinstance(answer, Mismatch):
        mismatch = FingerprintMismatchError(key)
        return Verdict(Action.DEAD_LETTER, Reason.MISMATCH, key, error=mismatch)
    if isinstance(answer, CorruptRecordError):
        return Verdict(Action.DEAD_LETTER, Reason.CORRUPT_RECORD, key, error=answer)
    error = answer if isinstance(answer, Exception) else TypeError(f"claim answered {answer!r}")
    return Verdict(Action.RETRY, Reason.STORE_UNAVAILABLE, key, retry_delay(policy), error=error)


def report(key: str, answer: object, verdict: Verdict | None, store: object) -> None:
    """Log the decision `decide` reached (an acquired lease is logged where it is made)."""
    if verdict is None:
        return
    reason = verdict.reason
    if reason is Reason.DUPLICATE:
        return  # logged with the replay's record
    if reason is Reason.IN_PROGRESS:
        logger.info(
            "duplicate in progress key=%s",
            key,
            extra=fields(key=key, store=store, outcome="in_progress"),
        )
    elif reason is Reason.MISMATCH:
        logger.error(
            "message dead-lettered: key=%s was used for another payload",
            key,
            extra=fields(key=key, store=store, outcome="dead_lettered"),
        )
    elif reason is Reason.CORRUPT_RECORD:
        logger.error(
            "message dead-lettered: the record of key=%s is corrupt (%s)",
            key,
            verdict.error,
            extra=fields(key=key, store=store, outcome="dead_lettered"),
        )
    elif reason is Reason.STORE_UNAVAILABLE:
        logger.warning(
            "store error claiming key=%s; redelivering later: %s",
            key,
            verdict.error,
            extra=fields(key=key, store=store, outcome="store_unavailable"),
        )
    elif isinstance(answer, Acquired):  # exhausted: workers died mid-handler
        logger.error(
            "message dead-lettered: key=%s was started %d times without finishing",
            key,
            answer.attempt - 1,
            extra=fields(
                key=key,
                token=answer.token,
                attempt=answer.attempt,
                store=store,
                outcome="dead_lettered",
            ),
        )
    else:  # a failed record: dead-lettered before
        logger.error(
            "message dead-lettered: key=%s was dead-lettered before",
            key,
            extra=fields(key=key, store=store, outcome="dead_lettered"),
        )
