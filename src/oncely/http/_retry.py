"""The client side's retry loop as one sans-I/O flow, run by the sync and the async transport.

The flow decides; the transports act. It yields `SendOp` (send the request once more, read the
whole response, and send it back, or throw the transport's exception in), `CloseOp` (discard a
response that will be retried) and `SleepOp`; it returns the response to hand to the caller or
raises. It imports no HTTP library: responses are read only through ``status_code`` and
``headers.get("retry-after")``.

When the attempts or the time run out after an attempt that may have taken effect (an error
once the request may have been sent), the transport's ``outcome_unknown`` error is raised
instead of the last error or the last refusal (409, 429, 503), so the caller retries with the
same key rather than a new one. When every attempt failed to connect or was refused, the last
error is raised (or the response returned) as is: the refusals say what happened.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from oncely._core.flow import Flow
from oncely._core.policy import Duration, to_timedelta
from oncely._log import fields, get_logger
from oncely.errors import ConfigurationError

__all__ = ["CloseOp", "RetryPolicy", "SendOp", "SleepOp", "parse_retry_after", "retry_flow"]

logger = get_logger("oncely.http.client")


@dataclass(frozen=True, slots=True)
class SendOp:
    """Send the request (again) and read the whole response; *attempt* counts from 1."""

    attempt: int


@dataclass(frozen=True, slots=True)
class CloseOp:
    """Close a response that is about to be retried."""

    response: Any


@dataclass(frozen=True, slots=True)
class SleepOp:
    """Wait *seconds* before the next attempt."""

    seconds: float


RETRY_STATUSES: Final = frozenset({409, 429, 503})
"""Statuses that mean "not processed now, try again": in progress, rate limited, unavailable."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When and how long the client transports retry a covered request.

    Attributes:
        max_attempts: Attempts in all, the first included.
        max_elapsed: The time budget across attempts and pauses; a pause that would end past
            it is not taken (the last response or error is returned or raised instead).
        backoff: The first pause when the server gives no ``Retry-After``; it doubles after
            every attempt, with full jitter, up to *max_backoff*.
        max_backoff: The longest pause between attempts (a longer ``Retry-After`` of a 429 or
            503 is honoured as long as it fits in *max_elapsed*; a 409's is capped at it, since
            the request in progress may finish any moment).
        statuses: Response statuses that are retried.
    """

    max_attempts: int = 5
    max_elapsed: Duration = timedelta(seconds=30)
    backoff: Duration = timedelta(milliseconds=100)
    max_backoff: Duration = timedelta(seconds=5)
    statuses: Collection[int] = RETRY_STATUSES

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigurationError("max_attempts must be an int")
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        for name in ("max_elapsed", "backoff", "max_backoff"):
            object.__setattr__(self, name, to_timedelta(getattr(self, name), name))
        object.__setattr__(self, "statuses", frozenset(self.statuses))

    def pause(self, attempt: int, rng: random.Random) -> float:
        """The jittered exponential pause after failed attempt number *attempt*."""
        ceiling = min(_seconds(self.max_backoff), _seconds(self.backoff) * 2 ** (attempt - 1))
        return rng.uniform(ceiling / 2, ceiling)


def _seconds(value: Duration) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


MAX_RETRY_AFTER = 86400.0
"""The longest pause a ``Retry-After`` asks for that is taken as it is (a day): a longer one,
a date years ahead or a number of twenty digits, is taken as this."""


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value, or ``None`` when it has none.

    RFC 9110: delay-seconds (ASCII digits only) or an HTTP date; anything else is absent. The
    answer is at most `MAX_RETRY_AFTER`.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # "²" and "٣" are digits to isdigit, not to RFC 9110
        # A long run of digits is over the cap anyway: never converted whole.
        return min(float(value[:12]) if len(value) <= 12 else MAX_RETRY_AFTER, MAX_RETRY_AFTER)
    if not value.isascii():
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return min(max(0.0, (when - now).total_seconds()), MAX_RETRY_AFTER)


def retry_flow(
    policy: RetryPolicy,
    *,
    retryable: Callable[[BaseException], bool],
    rng: random.Random,
    describe: str = "",
    unsent: Callable[[BaseException], bool] = lambda exc: False,
    outcome_unknown: Callable[[Any, int], BaseException] | None = None,
) -> Flow[Any]:
    """Send until a response that is not retried, or the attempts or the time run out.

    Args:
        policy: When and how long to retry.
        retryable: Whether an attempt's error is retried.
        rng: The jitter's source.
        describe: Names the request in log lines.
        unsent: Whether an error shows that the attempt never reached the server (it could not
            connect), so it cannot have taken effect.
        outcome_unknown: Builds the error raised when the flow gives up after an attempt that
            may have taken effect (an error once the request may have been sent), from the last
            error or response and the number of attempts. Without it, the last error is
            raised or the last response returned.
    """
    budget = _seconds(policy.max_elapsed)
    started = time.monotonic()
    attempt = 0
    uncertain = False  # an attempt may have taken effect (or is taking it now)
    while True:
        attempt += 1
        try:
            response = yield SendOp(attempt)
        except Exception as exc:
            if not retryable(exc):
                # Not a transport failure (a bad URL, a bug): this attempt ran nothing, but
                # an earlier one may have.
                if uncertain and outcome_unknown is not None:
                    raise outcome_unknown(exc, attempt) from exc
                raise
            uncertain = uncertain or not unsent(exc)
            pause = policy.pause(attempt, rng)
            if not _may_retry(policy, attempt, started, budget, pause):
                if uncertain and outcome_unknown is not None:
                    raise outcome_unknown(exc, attempt) from exc
                raise
            logger.info(
                "retrying %s after %s (attempt %d, pause %.3fs)",
                describe,
                type(exc).__name__,
                attempt,
                pause,
                extra=fields(attempt=attempt, outcome="retry"),
            )
        else:
            status = response.status_code
            if status not in policy.statuses:
                return response
            hinted = parse_retry_after(response.headers.get("retry-after"))
            if hinted is not None and status == 409:
                # "Still in progress" may end any moment: its Retry-After is a hint to poll,
                # capped so that a server that names the lease's remaining time (older oncely
                # sent up to a whole lease) is still polled within the budget.
                hinted = min(hinted, _seconds(policy.max_backoff))
            pause = hinted if hinted is not None else policy.pause(attempt, rng)
            if not _may_retry(policy, attempt, started, budget, pause):
                if uncertain and outcome_unknown is not None:
                    # "Not now" answers the last attempt only: an earlier one may have run.
                    yield CloseOp(response)
                    raise outcome_unknown(response, attempt)
                return response
            logger.info(
                "retrying %s after status %d (attempt %d, pause %.3fs)",
                describe,
                status,
                attempt,
                pause,
                extra=fields(attempt=attempt, outcome="retry"),
            )
            yield CloseOp(response)
        yield SleepOp(pause)


def _may_retry(
    policy: RetryPolicy, attempt: int, started: float, budget: float, pause: float
) -> bool:
    return attempt < policy.max_attempts and time.monotonic() - started + pause <= budget
