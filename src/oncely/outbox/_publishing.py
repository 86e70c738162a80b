"""What every broker publisher shares: per-key order over pipelined confirms, and option checks.

A publisher hands `publish_ordered` a *send* coroutine that gives one event to its driver (in
call order, so the driver writes it to one ordered channel) and returns an awaitable of the
broker's confirmation. Sends are pipelined: the next event goes out without waiting for the
previous confirmation, and every confirmation is awaited together at the end.

Outcomes follow the `oncely.outbox.Publisher` contract:

* an event whose send raised, or whose confirmation failed or did not come within *timeout*,
  answers its error;
* the first failure of an ordering key is that key's error: later events of the key that were
  not sent yet are not sent, and those already in the pipeline that the broker did not confirm
  answer `NOT_ATTEMPTED` too (the failure is the first event's, not theirs, so it does not count
  against them). A later event the broker did confirm answers ``None``: it is published, and
  saying otherwise would only publish it twice.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from oncely.errors import ConfigurationError
from oncely.outbox._event import NOT_ATTEMPTED, OutboxEvent, Outcome

__all__ = ["check_options", "masked", "publish_ordered", "positive"]

Send = Callable[[OutboxEvent], Awaitable[Awaitable[Any]]]
"""Hand one event to the driver; return an awaitable of the broker's confirmation."""


async def publish_ordered(
    events: Sequence[OutboxEvent],
    send: Send,
    *,
    timeout: float | None,
    flush: Callable[[], Awaitable[None]] | None = None,
) -> list[Outcome]:
    """Send *events* in order through *send*, then call *flush* (which sends what *send*
    queued, for a driver that pipelines explicitly), await the confirmations, return the
    outcomes. *flush* raising is a failure of the whole call: it propagates."""
    outcomes: list[Outcome] = [None] * len(events)
    confirms: dict[int, asyncio.Future[Any]] = {}
    failed: set[str] = set()  # keys whose later events are not sent

    def on_done(key: str) -> Callable[[asyncio.Future[Any]], None]:
        def done(future: asyncio.Future[Any]) -> None:
            if future.cancelled() or future.exception() is not None:
                failed.add(key)

        return done

    try:
        for index, event in enumerate(events):
            key = event.ordering_key
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
            if key is not None:  # a refusal that arrives meanwhile stops the key's next sends
                confirm.add_done_callback(on_done(key))
            confirms[index] = confirm
        if flush is not None and confirms:
            await flush()
        if confirms:
            await asyncio.wait(confirms.values(), timeout=timeout)
        for index, answer in confirms.items():
            if not answer.done():
                outcomes[index] = TimeoutError(f"no confirmation from the broker in {timeout}s")
            elif answer.cancelled():  # by the driver, as its connection closed
                outcomes[index] = ConnectionError("the driver dropped the confirmation")
            else:
                outcomes[index] = answer.exception()
    finally:
        for pending in confirms.values():
            if not pending.done():
                pending.cancel()
    return _attribute_to_first_failure(events, outcomes)


def _attribute_to_first_failure(
    events: Sequence[OutboxEvent], outcomes: list[Outcome]
) -> list[Outcome]:
    """After a key's first failure, its later unconfirmed events answer `NOT_ATTEMPTED`."""
    broken: set[str] = set()
    for index, event in enumerate(events):
        key = event.ordering_key
        if key is None or outcomes[index] is None:
            continue
        if key in broken:
            outcomes[index] = NOT_ATTEMPTED
        elif isinstance(outcomes[index], BaseException):
            broken.add(key)
    return outcomes


def check_options(target: Callable[..., Any], options: Mapping[str, Any], what: str) -> None:
    """Raise `ConfigurationError` for an option *target* (a driver's constructor) does not take,
    now rather than at the first publish."""
    parameters = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(options) - set(parameters))
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
