"""OpenTelemetry metrics and spans for oncely (the ``otel`` extra: ``pip install 'oncely[otel]'``).

.. code-block:: python

    import oncely.observe.otel

    oncely.observe.otel.install()    # the global MeterProvider and TracerProvider

Metrics: ``oncely.operations`` and ``oncely.operation.duration`` (s) with the attributes
``surface``, ``operation``, ``store`` and ``outcome``; ``oncely.store.operation.duration`` (s)
with ``db.system.name``, ``db.operation.name`` and ``error.type`` when the verb raised; the
counters ``oncely.lease.lost``, ``oncely.heartbeats``, ``oncely.consumer.verdicts``,
``oncely.dead_letters``, ``oncely.outbox.written`` and ``oncely.outbox.published``; and the
gauges ``oncely.outbox.pending``, ``oncely.outbox.dead`` and
``oncely.outbox.oldest_pending_age`` (s). A Prometheus exporter names them as
`oncely.observe.prometheus` does (``oncely_operations_total``...).

Spans (never carrying the key): an INTERNAL span ``oncely {operation}`` around each decorated
call, `oncely.Guard` block and inbox entry; a CONSUMER span ``process {destination}`` per
delivery (a duplicate ends OK, not as an error); a PRODUCER span ``send {destination}`` per
event the relay publishes, linked to the trace that wrote the event (the writer stores its
``traceparent`` in the event's headers, which the broker then carries too). HTTP requests get
no span of their own: the outcome goes on the framework's server span as attributes. Each span
carries ``oncely.scope``, ``oncely.outcome``, ``oncely.fencing_token`` and ``oncely.attempt``,
and nests under the span current when the operation starts; the store drivers' spans nest
under it.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from oncely import _events
from oncely._deps import require

__all__ = ["install", "uninstall"]

_trace = require("opentelemetry.trace", extra="otel")
_metrics = require("opentelemetry.metrics", extra="otel")
_context = require("opentelemetry.context", extra="otel")
_propagate = require("opentelemetry.propagate", extra="otel")

SCOPE_NAME = "oncely"

_installed: list[_Exporter] = []
_lock = threading.Lock()

_SPANNED = frozenset({"function", "inbox", "consumer"})
_OK_OUTCOMES = frozenset({"acquired", "recovered", "replayed", "in_progress"})


def install(meter_provider: Any = None, tracer_provider: Any = None) -> Callable[[], None]:
    """Report oncely's metrics to *meter_provider* and its spans to *tracer_provider* (the
    global providers when ``None``), and propagate the trace context into outbox events.

    Idempotent: installing again with the same providers changes nothing. Returns a function
    that stops it.
    """
    with _lock:
        for exporter in _installed:
            if exporter.providers == (meter_provider, tracer_provider):
                return exporter.close
        exporter = _Exporter(meter_provider, tracer_provider)
        _installed.append(exporter)
    return exporter.close


def uninstall() -> None:
    """Stop every installation."""
    with _lock:
        exporters = list(_installed)
    for exporter in exporters:
        exporter.close()


class _Exporter:
    def __init__(self, meter_provider: Any, tracer_provider: Any) -> None:
        self.providers = (meter_provider, tracer_provider)
        try:
            from oncely import __version__ as version
        except ImportError:  # run from a source tree, not installed: no version to report
            version = None
        meter = _metrics.get_meter(SCOPE_NAME, version, meter_provider)
        self.tracer = _trace.get_tracer(SCOPE_NAME, version, tracer_provider)
        self.operations = meter.create_counter(
            "oncely.operations", "{operation}", "Protected operations, by claim outcome."
        )
        self.durations = meter.create_histogram(
            "oncely.operation.duration", "s", "How long protected operations took."
        )
        self.store_durations = meter.create_histogram(
            "oncely.store.operation.duration", "s", "How long the store verbs oncely calls took."
        )
        self.lost = meter.create_counter("oncely.lease.lost", "{lease}", "Leases taken over.")
        self.beats = meter.create_counter(
            "oncely.heartbeats", "{extend}", "Heartbeat extends, by result."
        )
        self.verdicts = meter.create_counter(
            "oncely.consumer.verdicts", "{message}", "Consumer verdicts, by action and reason."
        )
        self.dead = meter.create_counter(
            "oncely.dead_letters", "{message}", "Messages and outbox events given up on."
        )
        self.written = meter.create_counter(
            "oncely.outbox.written", "{event}", "Events added to the outbox."
        )
        self.published = meter.create_counter(
            "oncely.outbox.published", "{event}", "Outbox publish attempts, by result."
        )
        self.backlog: _events.OutboxBacklog | None = None
        meter.create_observable_gauge(
            "oncely.outbox.pending", [self._pending], "{event}", "Events waiting to be published."
        )
        meter.create_observable_gauge(
            "oncely.outbox.dead", [self._dead], "{event}", "Events the relay gave up on."
        )
        meter.create_observable_gauge(
            "oncely.outbox.oldest_pending_age",
            [self._oldest],
            "s",
            "Age of the oldest unpublished event: the relay's lag.",
        )
        self._unsubscribe = _events.subscribe(self.on_event)
        _events.injectors.append(self.inject)
        self.closed = False

    def close(self) -> None:
        with _lock:
            if self.closed:
                return
            self.closed = True
            if self in _installed:
                _installed.remove(self)
        self._unsubscribe()
        if self.inject in _events.injectors:
            _events.injectors.remove(self.inject)

    # -- trace context into the outbox ---------------------------------------------------------

    def inject(self, carrier: dict[str, str]) -> None:
        _propagate.inject(carrier)

    # -- gauges --------------------------------------------------------------------------------

    def _observe(self, value: Callable[[_events.OutboxBacklog], float | None]) -> Iterable[Any]:
        backlog = self.backlog
        if backlog is None:
            return []
        measured = value(backlog)
        return [] if measured is None else [_metrics.Observation(measured)]

    def _pending(self, options: Any) -> Iterable[Any]:
        return self._observe(lambda backlog: backlog.pending)

    def _dead(self, options: Any) -> Iterable[Any]:
        return self._observe(lambda backlog: backlog.dead)

    def _oldest(self, options: Any) -> Iterable[Any]:
        return self._observe(lambda backlog: backlog.oldest_age or 0.0)

    # -- events --------------------------------------------------------------------------------

    def on_event(self, event: _events.Event) -> None:
        if isinstance(event, _events.Started):
            if event.surface in _SPANNED:
                self.start_span(event)
        elif isinstance(event, _events.Operation):
            attributes = {
                "surface": event.surface,
                "operation": event.operation,
                "store": event.store,
                "outcome": event.outcome,
            }
            self.operations.add(1, attributes)
            if event.duration is not None:
                self.durations.record(event.duration, attributes)
            self.end_span(event)
        elif isinstance(event, _events.StoreCall):
            store = {"db.system.name": _db_system(event.store), "db.operation.name": event.verb}
            if event.error is not None:
                store["error.type"] = event.error
            self.store_durations.record(event.duration, store)
        elif isinstance(event, _events.LeaseLost):
            self.lost.add(1, {"operation": event.operation, "during": event.during})
        elif isinstance(event, _events.Heartbeat):
            result = "ok" if event.ok else "failed"
            self.beats.add(1, {"operation": event.operation, "result": result})
        elif isinstance(event, _events.Verdict):
            self.verdicts.add(
                1, {"operation": event.operation, "action": event.action, "reason": event.reason}
            )
        elif isinstance(event, _events.DeadLetter):
            self.dead.add(
                1, {"surface": event.surface, "operation": event.operation, "reason": event.reason}
            )
        elif isinstance(event, _events.OutboxWritten):
            self.written.add(1, {"destination": event.destination})
        elif isinstance(event, _events.OutboxPublished):
            result = "published" if event.error is None else "failed"
            self.published.add(1, {"destination": event.destination, "result": result})
            self.send_span(event)
        elif isinstance(event, _events.OutboxBacklog):
            self.backlog = event

    def start_span(self, event: _events.Started) -> None:
        if event.surface == "consumer":
            destination = event.destination or event.operation or "oncely"
            span = self.tracer.start_span(
                f"process {destination}",
                kind=_trace.SpanKind.CONSUMER,
                links=_producer_links(event.headers),
                start_time=event.start_ns,
                attributes={
                    "messaging.operation.type": "process",
                    "messaging.operation.name": "process",
                    **({"messaging.destination.name": destination} if event.destination else {}),
                },
            )
        else:
            span = self.tracer.start_span(
                f"oncely {event.operation}" if event.operation else "oncely",
                kind=_trace.SpanKind.INTERNAL,
                start_time=event.start_ns,
            )
        token = _context.attach(_trace.set_span_in_context(span))
        event.handle.slots[SCOPE_NAME] = (span, token)

    def end_span(self, event: _events.Operation) -> None:
        attributes: dict[str, Any] = {
            "oncely.surface": event.surface,
            "oncely.scope": event.operation,
            "oncely.outcome": event.outcome,
            "oncely.store": event.store,
        }
        if event.token is not None:
            attributes["oncely.fencing_token"] = event.token
        if event.attempt:
            attributes["oncely.attempt"] = event.attempt
        if event.detail is not None and event.surface == "consumer":
            attributes["oncely.reason"] = event.detail
        opened = None if event.handle is None else event.handle.slots.pop(SCOPE_NAME, None)
        if opened is None:
            if event.surface in ("http", "client"):  # on the framework's (or client's) span
                current = _trace.get_current_span()
                if current.is_recording():
                    current.set_attributes(attributes)
            return
        span, token = opened
        _context.detach(token)
        span.set_attributes(attributes)
        if event.operation and event.surface != "consumer":
            span.update_name(f"oncely {event.operation}")
        failed = event.outcome not in _OK_OUTCOMES or (
            event.error is not None and event.surface != "consumer"
        )
        if event.surface == "consumer":
            failed = event.detail in ("handler_failed", "exhausted", "mismatch", "corrupt_record")
        if failed:
            if event.error is not None:
                span.set_attribute("error.type", event.error)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR))
        span.end(end_time=event.end_ns)

    def send_span(self, event: _events.OutboxPublished) -> None:
        links = []
        parent = _propagate.extract(dict(event.headers))
        linked = _trace.get_current_span(parent).get_span_context()
        if linked.is_valid:
            links.append(_trace.Link(linked))
        span = self.tracer.start_span(
            f"send {event.destination}",
            kind=_trace.SpanKind.PRODUCER,
            links=links,
            attributes={
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": event.destination,
                "oncely.attempt": event.attempts,
            },
        )
        if event.error is not None:
            span.set_attribute("error.type", event.error)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR))
        span.end()


def _producer_links(headers: Mapping[str, Any]) -> list[Any]:
    """A link to the trace that produced a message, from its ``traceparent`` header."""
    carrier = {
        str(name).lower(): value.decode("latin-1") if isinstance(value, bytes) else str(value)
        for name, value in headers.items()
        if str(name).lower() in ("traceparent", "tracestate")
    }
    if "traceparent" not in carrier:
        return []
    linked = _trace.get_current_span(_propagate.extract(carrier)).get_span_context()
    return [_trace.Link(linked)] if linked.is_valid else []


def _db_system(store: str) -> str:
    """The ``db.system.name`` of a store backend (OpenTelemetry's well-known values)."""
    return "postgresql" if store == "postgres" else store
