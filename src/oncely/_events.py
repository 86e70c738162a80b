"""One event stream for every entry point: typed, frozen events and a process-wide subscriber list.

Entry points report what happened (a claim's outcome, a store call's latency, a consumer's
verdict, an outbox publish) as events; exporters (`oncely.observe.prometheus`,
`oncely.observe.otel`) and user callbacks (`oncely.observe.subscribe`) turn them into metrics,
spans or anything else. With no subscriber nothing is built: each emit site reads the
module-level flag `on` first, so an unobserved process pays one attribute read per site.

A subscriber is called synchronously, in the thread (and context) of the operation, before the
operation returns to its caller. One that raises is logged once and never breaks the operation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from oncely._log import get_logger

__all__ = [
    "DeadLetter",
    "Event",
    "Handle",
    "Heartbeat",
    "LeaseLost",
    "Operation",
    "OutboxBacklog",
    "OutboxPublished",
    "OutboxWritten",
    "Outcome",
    "Started",
    "StoreCall",
    "Surface",
    "Verdict",
    "emit",
    "injectors",
    "on",
    "subscribe",
]

logger = get_logger("oncely.observe")

Outcome: TypeAlias = Literal[
    "acquired", "recovered", "replayed", "in_progress", "mismatch", "refused", "error"
]
"""How an operation's claim was answered: it ran (``acquired``, or ``recovered`` from a worker
whose lease expired), a duplicate was answered from its record (``replayed``), turned away
while the first runs (``in_progress``) or for another payload (``mismatch``), turned away
before any claim (``refused``: an invalid or missing key), or the store failed (``error``)."""

Surface: TypeAlias = Literal["function", "http", "client", "consumer", "inbox", "outbox"]
"""Which kind of entry point reported an operation (``client``: the httpx transport)."""


@dataclass(frozen=True, slots=True)
class Operation:
    """One protected operation, reported once when it ends.

    Attributes:
        surface: The kind of entry point.
        operation: What ran, as a bounded name: the key's scope (the qualified function name,
            the route, the consumer's scope); never the key itself.
        store: The store's backend name (``memory``, ``sqlite``, ``postgres``, ``redis``...).
        outcome: How its claim was answered (see `Outcome`).
        duration: Seconds from the start of the operation to its end (``None`` when not timed,
            a message decided in a batch).
        token: The fencing token of the lease, when one was held or replayed.
        attempt: The attempt number of the lease (0 when none was held).
        error: The class name of the exception the operation ended with, if any.
        detail: A bounded detail of the surface: the HTTP status, the consumer's verdict reason.
        end_ns: When it ended (epoch nanoseconds), for an operation reported after the fact (a
            batch's delivery, decided once every handler of the batch ran); ``None``: now.
    """

    surface: Surface
    operation: str
    store: str
    outcome: Outcome
    duration: float | None = None
    token: int | None = None
    attempt: int = 0
    error: str | None = None
    detail: str | None = None
    handle: Handle | None = field(default=None, compare=False, repr=False)
    end_ns: int | None = None


class Handle:
    """The identity of one operation, shared by its `Started` and `Operation` events: an
    exporter keeps what it opened at the start (a span) in `slots`, by its own name."""

    __slots__ = ("slots",)

    def __init__(self) -> None:
        self.slots: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class Started:
    """An operation started (its `Operation` event follows, with the same *handle*).

    Attributes:
        surface: The kind of entry point.
        operation: Its bounded name where known yet (an HTTP request's route is known once
            claimed: empty until then).
        store: The store's backend name.
        handle: Shared with the operation's `Operation` event.
        destination: Where a consumed message came from (a queue, topic, subject or stream),
            where the broker's message says.
        headers: A consumed message's headers (its ``traceparent`` names the trace that
            produced it); empty for other operations.
        start_ns: When it began (epoch nanoseconds), for an operation reported after the fact
            (see `Operation.end_ns`); ``None``: now.
    """

    surface: Surface
    operation: str
    store: str
    handle: Handle = field(compare=False, repr=False)
    destination: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    start_ns: int | None = None


@dataclass(frozen=True, slots=True)
class StoreCall:
    """One store verb called by an entry point: its latency, and its error's class if it failed.

    Attributes:
        store: The store's backend name.
        verb: The verb without the async ``a`` prefix: ``claim``, ``complete``, ``extend``...
        duration: Seconds the call took.
        error: The class name of what it raised (``StoreUnavailableError``...), or ``None``.
    """

    store: str
    verb: str
    duration: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """A lease was found taken over: by a heartbeat, or when settling.

    Attributes:
        operation: The key's scope.
        token: The fencing token that lost the lease.
        during: ``heartbeat``, or the settle verb (``complete``, ``fail``, ``release``).
    """

    operation: str
    token: int
    during: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One heartbeat beat: the lease was extended (``ok``), or the extend failed or timed out."""

    operation: str
    token: int
    ok: bool


@dataclass(frozen=True, slots=True)
class Verdict:
    """A consumer's decision for one delivery.

    Attributes:
        operation: The consumer's scope.
        action: ``ack``, ``retry`` or ``dead_letter``.
        reason: Why (``processed``, ``duplicate``, ``handler_failed``...).
    """

    operation: str
    action: str
    reason: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message or outbox event given up on.

    Attributes:
        surface: ``consumer`` (a delivery dead-lettered) or ``outbox`` (an event the relay
            stopped retrying).
        operation: The consumer's scope, or the event's destination.
        reason: Why, as a bounded name.
    """

    surface: Surface
    operation: str
    reason: str


@dataclass(frozen=True, slots=True)
class OutboxWritten:
    """An event was added to the outbox in the caller's transaction (published once it
    commits)."""

    destination: str


@dataclass(frozen=True, slots=True)
class OutboxPublished:
    """The relay tried to publish one event.

    Attributes:
        destination: Where it went.
        attempts: Publish attempts, this one included.
        error: The class name of the publish error (``None``: published).
        headers: The event's headers (a ``traceparent`` there links to the writer's trace).
    """

    destination: str
    attempts: int
    error: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class OutboxBacklog:
    """The outbox after a relay cycle: events waiting and dead, and the oldest one's age.

    Attributes:
        pending: Events committed and not yet published.
        dead: Events the relay gave up on.
        oldest_age: Seconds since the oldest pending event was committed (``None``: none).
    """

    pending: int
    dead: int
    oldest_age: float | None


Event: TypeAlias = (
    Started
    | Operation
    | StoreCall
    | LeaseLost
    | Heartbeat
    | Verdict
    | DeadLetter
    | OutboxWritten
    | OutboxPublished
    | OutboxBacklog
)
"""Every event the stream carries."""

Subscriber: TypeAlias = Callable[[Event], object]

on: bool = False
"""Whether anything subscribes: every emit site checks this before it builds an event."""

_subscribers: tuple[Subscriber, ...] = ()

injectors: list[Callable[[dict[str, str]], None]] = []
"""Functions that add the current trace context to a carrier (the OpenTelemetry exporter's):
the outbox writer stores what they add in the event's headers."""
_failed: set[int] = set()  # ids of subscribers whose failure was logged
_lock = threading.Lock()


def subscribe(callback: Subscriber) -> Callable[[], None]:
    """Call *callback* with every event from now on; return a function that unsubscribes it.

    Subscribing the same callback twice delivers each event to it twice.
    """
    global on, _subscribers
    if not callable(callback):
        raise TypeError(f"a subscriber is a callable, not {callback!r}")
    entry = _Entry(callback)
    with _lock:
        _subscribers = (*_subscribers, entry)
        on = True

    def unsubscribe() -> None:
        global on, _subscribers
        with _lock:
            _subscribers = tuple(each for each in _subscribers if each is not entry)
            on = bool(_subscribers)
            _failed.discard(id(entry))

    return unsubscribe


class _Entry:
    """One subscription (a callback subscribed twice is two entries)."""

    __slots__ = ("callback",)

    def __init__(self, callback: Subscriber) -> None:
        self.callback = callback

    def __call__(self, event: Event) -> object:
        return self.callback(event)


def emit(event: Event) -> None:
    """Hand *event* to every subscriber; one that raises is logged once and skipped."""
    for subscriber in _subscribers:
        try:
            subscriber(event)
        except Exception:
            if id(subscriber) not in _failed:
                _failed.add(id(subscriber))
                logger.exception(
                    "an oncely event subscriber raised (logged once; the operation goes on): %r",
                    getattr(subscriber, "callback", subscriber),
                )
