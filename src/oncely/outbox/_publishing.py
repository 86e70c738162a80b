"""What every broker publisher shares: per-scope order over pipelined confirms, and option checks.

A publisher hands `publish_ordered` a *send* coroutine that gives one event to its driver (in
call order, so the driver writes it to one ordered channel) and returns an awaitable of the
broker's confirmation. Sends are pipelined: the next event goes out without waiting for the
previous confirmation, and every confirmation is awaited together at the end.

Outcomes follow the `oncely.outbox.Publisher` contract:

* an event whose send raised, or whose confirmation failed or did not come within *timeout*,
  answers its error;
* order is kept per scope: a destination and an ordering key (`oncely.outbox._event.scope`).
  The first failure of a scope is that scope's error, and its later events are not sent.
  Most failures are a destination's (no such exchange, stream or topic; a key of another type),
  so the first event of a scope to a destination not yet *proven* (confirmed once by this
  publisher) is confirmed before the scope's next event is sent: then a later event never
  reaches the broker ahead of an earlier one refused there. Once proven, a destination is
  pipelined; if one of its events still fails (the broker refused it, or its connection
  dropped), the scope's later events already in the pipeline answer `NOT_ATTEMPTED`, those the
  broker confirmed too (`in_order`): an event counts as published only when every earlier
  event of its scope was. Those already confirmed are published again after the failed one
  (the consumer deduplicates them by message id).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from oncely.errors import ConfigurationError
from oncely.outbox._event import NOT_ATTEMPTED, OutboxEvent, Outcome, Scope, in_order

__all__ = ["check_options", "masked", "publish_ordered", "positive"]

Send = Callable[[OutboxEvent], Awaitable[Awaitable[Any]]]
"""Hand one event to the driver; return an awaitable of the broker's confirmation."""


async def publish_ordered(
    events: Sequence[OutboxEvent],
    send: Send,
    *,
    timeout: float | None,
    proven: set[str],
    flush: Callable[[], Awaitable[None]] | None = None,
) -> list[Outcome]:
    """Send *events* in order through *send*, await their confirmations, return the outcomes.

    Args:
        events: In commit order.
        send: Hands one event to the driver (see `Send`).
        timeout: Seconds to wait for all the confirmations.
        proven: The destinations this publisher has had confirmed; updated.
        flush: For a driver that pipelines explicitly: sends what *send* queued. Raising is a
            failure of the whole call: it propagates.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    outcomes: list[Outcome] = [None] * len(events)
    confirms: dict[int, asyncio.Future[Any]] = {}
    failed: set[Scope] = set()  # scopes whose later events are not sent
    latest: dict[Scope, asyncio.Future[Any]] = {}  # each scope's last event sent
    probes: dict[asyncio.Future[Any], str] = {}  # events sent to an unproven destination

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - loop.time())

    try:
        for index, event in enumerate(events):
            ordering_key = event.ordering_key
            key = None if ordering_key is None else (event.destination, ordering_key)
            if key is not None and key not in failed and (last := latest.get(key)) is not None:
                if last in probes:
                    if not last.done():
                        if flush is not None:
                            await flush()
                        await asyncio.wait((last,), timeout=left())
                    if last.done() and not last.cancelled() and last.exception() is None:
                        proven.add(probes[last])
                    else:  # refused, or a probe not confirmed in time
                        failed.add(key)
                elif last.done() and (last.cancelled() or last.exception() is not None):
                    failed.add(key)
            if key is not None and key in failed:
                outcomes[index] = NOT_ATTEMPTED
                continue
            try:
                confirm: asyncio.Future[Any] = asyncio.ensure_future(await send(event))
            except Exception as exc:
                outcomes[index] = exc
                if key is not None:
                    failed.add(key)
                continue
            confirms[index] = confirm
            if key is not None:
                latest[key] = confirm
                if event.destination not in proven:
                    probes[confirm] = event.destination
        if flush is not None:
            await flush()
        if confirms and not all(answer.done() for answer in confirms.values()):
            await asyncio.wait(confirms.values(), timeout=left())
        for index, answer in confirms.items():
            if not answer.done():
                outcomes[index] = TimeoutError(f"no confirmation from the broker in {timeout}s")
            elif answer.cancelled():  # by the driver, as its connection closed
                outcomes[index] = ConnectionError("the driver dropped the confirmation")
            elif (error := answer.exception()) is not None:
                outcomes[index] = error
            else:
                proven.add(events[index].destination)
    finally:
        for pending in confirms.values():
            if not pending.done():
                pending.cancel()
    return in_order(events, outcomes)


def check_options(target: Callable[..., Any], options: Mapping[str, Any], what: str) -> None:
    """Raise `ConfigurationError` for an option *target* (a driver's constructor) does not name,
    now rather than at the first publish (its ``**kwargs``, if any, are not taken)."""
    parameters = inspect.signature(target).parameters
    named = {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = sorted(set(options) - named)
    if unknown:
        raise ConfigurationError(f"{what} takes no option {', '.join(map(repr, unknown))}")


def positive(value: float | None, name: str) -> float | None:
    """Return *value* (seconds) if it is ``None`` or a positive number, else raise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def masked(url: str) -> str:
    """*url* with its password replaced, for error messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{hosts}"
