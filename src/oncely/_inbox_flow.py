"""The transactional inbox's flow, once for sync and async, and for both of its forms (a claim in
the caller's transaction, `Inbox.transaction`'s own): when to claim, wait, replay, record an
outcome or undo. It speaks to the database only through `oncely._inbox_store`'s operations;
`oncely.inbox` drives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from oncely import _execution
from oncely._core import codec as _codec
from oncely._core.codec import Codec
from oncely._core.flow import Flow
from oncely._core.policy import Policy
from oncely._core.records import Acquired, ClaimResult, LeaseLost, Mismatch, Replay, Status
from oncely._inbox_store import Begin, Commit, Finish, InboxDriver, Open, Rollback
from oncely.errors import FingerprintMismatchError, InProgressError, LeaseLostError

__all__ = ["BUSY_HINT", "InboxView", "Plan", "end", "enter", "exit_flow", "open_flow"]


class InboxView(Protocol):
    """What the flows and the entries read of an `oncely.inbox.Inbox`: a protocol, so that
    they need not import the module that imports them."""

    @property
    def store(self) -> Any: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def codec(self) -> Codec: ...
    @property
    def _driver(self) -> InboxDriver: ...
    @property
    def _none(self) -> bytes: ...


BUSY_HINT = timedelta(seconds=1)
"""`InProgressError.retry_after` when another transaction holds the key: a short hint."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One claim's scoped key and fingerprint digest."""

    key: str
    fingerprint: str


def enter(inbox: InboxView, plan: Plan, own: bool) -> Flow[Acquired | Replay]:
    """Claim *plan*'s key (with *own*: in a transaction the claim opens, and that any answer
    but `Acquired` or `Replay` has ended), waiting or raising as the policy says."""
    policy = inbox.policy
    deadline = time.monotonic() + policy.wait_timeout.total_seconds()
    while True:
        wait = timedelta(0)
        if policy.on_conflict == "wait":
            wait = timedelta(seconds=max(deadline - time.monotonic(), 0))
        answer: ClaimResult = yield Begin(
            plan.key,
            plan.fingerprint,
            policy.lease,
            policy.ttl,
            wait,
            bool(policy.final_errors),
            inbox._none,
            own,
        )
        if isinstance(answer, (Acquired, Replay)):
            return answer
        if isinstance(answer, Mismatch):
            raise FingerprintMismatchError(plan.key)
        remaining = deadline - time.monotonic()
        if policy.on_conflict == "raise" or remaining <= 0:
            raise InProgressError(plan.key, retry_after=min(answer.retry_after, BUSY_HINT))
        # A lease held elsewhere (a transaction is waited for inside the claim itself).
        yield _execution.Sleep(min(answer.retry_after.total_seconds(), 0.05, remaining))


def exit_flow(
    inbox: InboxView, plan: Plan, token: int, value: Any, error: BaseException | None, own: bool
) -> Flow[None]:
    """Record the block's outcome, as the decorator does: a value, or a final error (which
    still propagates: whatever recording it raises is chained to it, never masking it). With
    *own*, the transaction the claim opened ends with it: committed, or rolled back."""
    policy = inbox.policy
    status = Status.COMPLETED
    if error is None and value is None:
        payload = inbox._none
    elif error is None:
        try:
            payload = _codec.encode_value(inbox.codec.encode(value))
        except Exception as exc:  # ran, but cannot be stored: replays fail loudly, never re-run
            payload = _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")
    elif isinstance(error, policy.final_errors):
        status, payload = Status.FAILED, _codec.encode_error(error)
    else:
        yield Rollback(end=own)
        return
    finish = Finish(plan.key, token, status, payload, policy.ttl, error is not None, own)
    try:
        answer = yield finish
        if isinstance(answer, LeaseLost):  # the row is ours until commit: only a foreign writer
            raise LeaseLostError(plan.key, token=token)
    except Exception as exc:
        if error is None:
            raise
        _execution.chain(error, exc)


def end(error: BaseException | None) -> Flow[None]:
    """End the transaction the inbox opened around a block that claimed nothing (a replay, or
    a disabled inbox's): committed, or rolled back when the block raised."""
    yield Commit() if error is None else Rollback(end=True)


def open_flow() -> Flow[None]:
    """Open the transaction of a disabled inbox's block, claiming nothing."""
    yield Open()
