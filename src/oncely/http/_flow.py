"""The store side of one protected HTTP request, as sans-I/O flows shared by ASGI and WSGI.

The flows reuse `oncely._execution` (claim with `acquire`, heartbeat, `settle`) and add only
the HTTP mapping: errors become problem responses, a replay becomes the stored response, and
the captured response decides between complete and release. `asgi.py` and the Django
middleware's async path run them with `_execution.arun` (settling through `asettle`),
`wsgi.py` and its sync path with `_execution.run`.

One request, in order::

    begin    claim ─┬─ Acquired  → lease (heartbeat started)  → the app runs
                    ├─ Replay    → stored response + marker
                    ├─ InProgress→ 409 + Retry-After: 1
                    ├─ Mismatch  → 422 (another request, or another principal's key);
                    │              an anonymous record of this very request answers any
                    │              caller: claimed again with its own fingerprint
                    └─ store down→ 503 + Retry-After (or pass through, if fail-open)
    finish   the app sent its last body chunk (held back until this returns):
             stored status and size → complete(snapshot); over the size limit →
             complete(marker); other statuses → release
    cut      the app had started its response, then the client left, the app raised or
             the request was cancelled → complete(marker): never released
    abort    the app raised, or returned, before it started a response → release
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Final

from oncely import _events, _execution, _observed
from oncely._core import codec as _codec
from oncely._core.flow import Flow
from oncely._core.machine import landed
from oncely._core.protocols import AsyncStore
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Replay,
    Status,
)
from oncely._log import fields, get_logger
from oncely.errors import (
    CorruptRecordError,
    FingerprintMismatchError,
    InProgressError,
    LeaseLostError,
    StoreError,
)
from oncely.http import _semantics
from oncely.http._policy import HttpPolicy
from oncely.http._semantics import Plan, Response, ResponseCapture

__all__ = [
    "PASS_THROUGH",
    "abort",
    "afinish",
    "asettle",
    "begin",
    "cut",
    "finish",
    "finish_with_trailers",
    "invoke",
    "settle_again",
    "stored_outcome",
]

logger = get_logger("oncely.http")

_VALUE_FRAME: Final = _codec.encode_value(b"")
"""What `_codec.encode_value` puts before the bytes it frames."""


class _PassThrough(enum.Enum):
    PASS_THROUGH = "PASS_THROUGH"


PASS_THROUGH: Final = _PassThrough.PASS_THROUGH
"""`begin`'s answer when the store failed on a fail-open route: serve the request unprotected."""


def begin(
    plan: Plan,
    policy: HttpPolicy,
    *,
    method: str,
    path: str,
    first: ClaimResult | Exception | None = None,
) -> Flow[_execution.Lease | Response | _PassThrough]:
    """Claim the request's key; return the lease (heartbeat started), the answer to send, or
    `PASS_THROUGH`.

    *first* is the answer to (or the error of) a first claim already sent: the flow goes on
    from it (see `asgi.py`'s straight line).
    """
    core = policy.core
    try:
        if isinstance(first, Exception):
            raise first
        answer: ClaimResult = first or (
            yield _execution.StoreCall(
                "claim", (plan.key, plan.fingerprint), {"lease": core.lease, "ttl": core.ttl}
            )
        )
        if isinstance(answer, Mismatch):
            return (yield from _mismatched(plan, answer.stored_fingerprint, policy))
        outcome = yield from _execution.acquire(plan.key, plan.fingerprint, core, answer)
    except InProgressError:
        return _semantics.in_progress()
    except FingerprintMismatchError:
        return _semantics.mismatch(policy)
    except CorruptRecordError as exc:  # never a reason to run again, fail-open or not
        logger.error(
            "corrupt record key=%s: %s",
            plan.key,
            exc,
            extra=fields(key=plan.key, outcome="corrupt"),
        )
        return _semantics.corrupt()
    except StoreError as exc:
        if policy.fail_open:
            logger.warning(
                "store unavailable, serving %s %s UNPROTECTED (fail-open) key=%s: %s",
                method,
                path,
                plan.key,
                exc,
                extra=fields(key=plan.key, outcome="unprotected"),
            )
            return PASS_THROUGH
        logger.error(
            "store unavailable, answering 503 for %s %s: %s",
            method,
            path,
            exc,
            extra=fields(key=plan.key, outcome="unavailable_503"),
        )
        return _semantics.unavailable(policy)
    if isinstance(outcome, Replay):
        return replay(outcome, policy)
    return outcome


def _mismatched(plan: Plan, stored: str, policy: HttpPolicy) -> Flow[Response]:
    """The answer to a claim whose record has the *stored* fingerprint, not the plan's.

    Store errors are raised for `begin` to answer.
    """
    verdict = _semantics.reusing(plan.fingerprint, stored)
    logger.info(
        "fingerprint mismatch key=%s (%s)",
        plan.key,
        verdict,
        extra=fields(key=plan.key, outcome="mismatch"),
    )
    if verdict in ("owned", "reused"):
        if _events.on:
            _observed.claimed(plan.key, "mismatch")
        if verdict == "owned":
            return _semantics.owned_elsewhere(policy)
        return _semantics.mismatch(policy)
    # An anonymous record of this very request (its response may have set the cookie this
    # request carries): it answers as it would its own owner. Claimed with its fingerprint,
    # so the store decides atomically between replay and in progress.
    core = policy.core
    answer = yield _execution.StoreCall(
        "claim", (plan.key, stored), {"lease": core.lease, "ttl": core.ttl}
    )
    if _events.on:
        _observed.claimed(plan.key, answer if isinstance(answer, Replay) else "in_progress")
    if isinstance(answer, Replay):
        _execution.suppressed(plan.key, answer)
        return replay(answer, policy)
    if isinstance(answer, Acquired):
        # The record was released, or its lease lapsed, since the first claim: the request is
        # to run again, under its own owner, not the anonymous one. Hand the lease back.
        try:
            yield _execution.StoreCall("release", (plan.key, answer.token))
        except StoreError as exc:  # the lease lapses on its own
            logger.warning("could not release key=%s: %s", plan.key, exc)
    elif not isinstance(answer, InProgress | Mismatch):  # pragma: no cover - broken store
        raise TypeError(f"claim answered {answer!r}")
    # In progress, or changed again meanwhile: fail closed; the retry decides afresh.
    return _semantics.in_progress()


def replay(outcome: Replay, policy: HttpPolicy) -> Response:
    """The answer to a repeat of a finished request (fail closed on anything unreadable)."""
    record = outcome.record
    try:
        if record.status is Status.COMPLETED:
            body = _codec.value_body(record.result)
            if body is not None:  # the common case, without decoding the outcome's frame
                return _semantics.replayed(body, policy)
        stored = _codec.decode_outcome(record.result)
        if stored.kind == "unavailable":
            return _semantics.not_replayable(stored.reason)
        if stored.kind != "value" or record.status is not Status.COMPLETED:
            raise ValueError(f"an HTTP record holds a {stored.kind} outcome")
        return _semantics.replayed(stored.body, policy)
    except ValueError as exc:
        logger.error(
            "corrupt record key=%s: %s",
            record.key,
            exc,
            extra=fields(key=record.key, token=record.token, outcome="corrupt"),
        )
        return _semantics.corrupt()


def invoke(lease: _execution.Lease) -> Flow[Any]:
    """Run the app under *lease* (so `oncely.current_lease()` works inside the handler)."""
    return (yield _execution.Invoke(lease))


def finish(lease: _execution.Lease, capture: ResponseCapture, policy: HttpPolicy) -> Flow[None]:
    """Settle the lease from the app's complete response: store it, mark it, or release it.

    Store failures are logged, not raised: the handler has run, so its response is delivered.
    """
    payload = stored_outcome(lease, capture, policy)
    if payload is None:
        yield from _settle(lease, "release", None, policy)
    else:
        yield from _settle(lease, "complete", payload, policy)


def stored_outcome(
    lease: _execution.Lease, capture: ResponseCapture, policy: HttpPolicy
) -> bytes | None:
    """What the record of a complete response is completed with (the framed snapshot, or the
    not-replayable marker of a response over the size limit); ``None``: release it."""
    if not capture.keep:
        return None
    if capture.overflowed:
        reason = f"the response body is over the {policy.max_response_bytes}-byte limit"
        logger.warning(
            "response of key=%s not stored: %s",
            lease.key,
            reason,
            extra=fields(key=lease.key, token=lease.token, outcome="not_stored"),
        )
        return _codec.encode_unavailable(reason)
    return capture.snapshot(policy, _VALUE_FRAME)  # `_codec.encode_value` of the snapshot


async def afinish(
    lease: _execution.Lease, capture: ResponseCapture, policy: HttpPolicy, store: AsyncStore
) -> None:
    """``asettle(partial(finish, lease, capture, policy), lease, store)``, with no flow on the
    common path: one complete that lands, then the heartbeat stopped. Any other answer or error
    goes on in `_settle`'s flow from the point reached, and a cancellation as `asettle` says.
    """
    payload = stored_outcome(lease, capture, policy)
    if payload is None:
        await asettle(partial(_settle, lease, "release", None, policy), lease, store)
        return
    lease.settling = True
    try:
        lost = await store.acomplete(lease.key, lease.token, payload, ttl=policy.core.ttl)
    except asyncio.CancelledError:
        flow = _settle(lease, "complete", payload, policy)
        await _shielded(_execution.arun(settle_again(lease, flow), store))
        raise
    except BaseException as exc:  # the flow decides: retry, log, or raise it again
        await asettle(
            partial(_settle, lease, "complete", payload, policy, (None, exc)), lease, store
        )
        return
    if lost is not None:
        await asettle(
            partial(_settle, lease, "complete", payload, policy, (lost, None)), lease, store
        )
    elif lease.heartbeat is not None:
        started = _execution.stop_async_heartbeat(lease)
        if started is not None:
            await asyncio.wait((started,))


def cut(
    lease: _execution.Lease, capture: ResponseCapture, cause: str, policy: HttpPolicy
) -> Flow[None]:
    """Settle the lease of a response that the app started and that was then cut short.

    The client went away, the app raised mid-response, or the request was cancelled (*cause*
    says which, for the log and the repeats' answer): the handler ran, so the key is never
    released (unless the status is one that is not stored, as for a whole response). The
    record is completed with a marker that makes repeats answer `_semantics.not_replayable`.
    """
    if not capture.keep:
        yield from _settle(lease, "release", None, policy)
        return
    reason = f"the response was cut short after the handler ran: {cause}"
    logger.warning(
        "response of key=%s not stored: %s",
        lease.key,
        reason,
        extra=fields(key=lease.key, token=lease.token, outcome="not_stored"),
    )
    yield from _settle(lease, "complete", _codec.encode_unavailable(reason), policy)


def finish_with_trailers(
    lease: _execution.Lease, capture: ResponseCapture, policy: HttpPolicy
) -> Flow[None]:
    """Settle the lease of a complete response with trailers (ASGI ``http.response.trailers``).

    Trailers are not part of the stored snapshot, so such a response is not replayable:
    repeats answer `_semantics.not_replayable` rather than a response without its trailers.
    """
    if not capture.keep:
        yield from _settle(lease, "release", None, policy)
        return
    reason = "the response has trailers, which are not stored"
    logger.warning(
        "response of key=%s not stored: %s",
        lease.key,
        reason,
        extra=fields(key=lease.key, token=lease.token, outcome="not_stored"),
    )
    yield from _settle(lease, "complete", _codec.encode_unavailable(reason), policy)


def abort(lease: _execution.Lease, exc: BaseException | None, policy: HttpPolicy) -> Flow[None]:
    """Release the lease of a request whose handler raised or sent no complete response."""
    if exc is None:
        logger.warning(
            "the app returned no complete response for key=%s",
            lease.key,
            extra=fields(key=lease.key, token=lease.token, outcome="released"),
        )
    yield from _settle(lease, "release", None, policy)


def settle_again(lease: _execution.Lease, flow: Flow[None]) -> Flow[None]:
    """Run a settling *flow* again after a cancellation cut its first run short.

    The first run's store call may have been applied before it was cancelled: if the record
    already shows this lease settled, there is nothing left to do (running the flow again
    would find the lease gone and log it as lost).
    """
    try:
        record = yield _execution.StoreCall("get", (lease.key,))
    except StoreError:
        record = None
    if landed(record, lease.token):
        return
    yield from flow


def _settle(
    lease: _execution.Lease,
    verb: str,
    payload: bytes | None,
    policy: HttpPolicy,
    first: tuple[LeaseLost | None, BaseException | None] | None = None,
) -> Flow[None]:
    try:
        yield from _execution.settle(lease, verb, payload, policy.core, first)
    except (StoreError, LeaseLostError) as exc:
        # The handler ran; the response still goes out. The key recovers after its lease.
        logger.error(
            "could not %s key=%s after the handler ran: %s",
            verb,
            lease.key,
            exc,
            extra=fields(key=lease.key, token=lease.token, outcome=f"{verb}_failed"),
        )


async def asettle(
    flow: Callable[[], Flow[None]], lease: _execution.Lease, store: AsyncStore
) -> None:
    """Run the settling *flow* to its end on *store*, even if the request is cancelled meanwhile.

    A cancellation mid-way (Starlette cancels a streaming response's task when the client
    leaves, a server cancels its requests when it stops) must not leave the record in
    progress: the handler has run, so a retry would run it again once the lease expired. The
    flow runs directly (no task: this is every request's path); only if it is cancelled is it
    run again (`settle_again`) in a task shielded from the cancellation, which is raised once
    that is done.
    """
    try:
        await _execution.arun(flow(), store)
    except asyncio.CancelledError:
        await _shielded(_execution.arun(settle_again(lease, flow()), store))
        raise


async def _shielded(work: Coroutine[Any, Any, None]) -> None:
    """Await *work* in a task of its own; a cancellation meanwhile is raised once it is done."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if task.done() and task.cancelled():  # the loop itself is going away
                raise
            cancelled = exc
            if not task.done():
                continue
        break
    if cancelled is not None:
        raise cancelled
