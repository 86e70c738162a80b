"""Prometheus metrics for oncely (the ``prometheus`` extra: ``pip install 'oncely[prometheus]'``).

.. code-block:: python

    from prometheus_client import start_http_server
    import oncely.observe.prometheus

    oncely.observe.prometheus.install()      # into prometheus_client's default registry
    start_http_server(9464)

Series (labels in brackets; never a key):

- ``oncely_operations_total`` and ``oncely_operation_duration_seconds`` [surface, operation,
  store, outcome]: every protected operation, by how its claim was answered.
- ``oncely_store_operation_duration_seconds`` [db_system_name, db_operation_name] and
  ``oncely_store_errors_total`` [db_system_name, db_operation_name, error_type]: the store
  verbs oncely calls (a driver's own instrumentation, redis-py's ``db.client.operation.duration``
  say, times the commands under them: this is one series per oncely verb, not a second count of
  the same commands).
- ``oncely_lease_lost_total`` [operation, during], ``oncely_heartbeats_total`` [operation,
  result].
- ``oncely_consumer_verdicts_total`` [operation, action, reason], ``oncely_dead_letters_total``
  [surface, operation, reason].
- ``oncely_outbox_written_total`` [destination], ``oncely_outbox_published_total``
  [destination, result], and the gauges ``oncely_outbox_pending``, ``oncely_outbox_dead`` and
  ``oncely_outbox_oldest_pending_age_seconds`` (the relay's lag, commit to publish).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from oncely import _events
from oncely._deps import require

__all__ = ["install", "uninstall"]

_prometheus = require("prometheus_client", extra="prometheus")

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Seconds: store calls take a fraction of a millisecond to tens of milliseconds, operations
up to their lease."""

_installed: dict[int, _Exporter] = {}
_lock = threading.Lock()


def install(registry: Any = None) -> Callable[[], None]:
    """Export oncely's metrics into *registry* (default: prometheus_client's ``REGISTRY``).

    Idempotent: installing again into the same registry changes nothing. Returns a function
    that removes the metrics from the registry and stops collecting them.
    """
    registry = registry if registry is not None else _prometheus.REGISTRY
    with _lock:
        exporter = _installed.get(id(registry))
        if exporter is None:
            exporter = _installed[id(registry)] = _Exporter(registry)
    return lambda: _remove(registry)


def uninstall(registry: Any = None) -> None:
    """Remove what `install` added to *registry* (every registry when ``None``)."""
    with _lock:
        targets = list(_installed) if registry is None else [id(registry)]
    for target in targets:
        exporter = _installed.get(target)
        if exporter is not None:
            _remove(exporter.registry)


def _remove(registry: Any) -> None:
    with _lock:
        exporter = _installed.pop(id(registry), None)
    if exporter is not None:
        exporter.close()


class _Exporter:
    def __init__(self, registry: Any) -> None:
        p = _prometheus
        self.registry = registry
        operation = ("surface", "operation", "store", "outcome")
        store = ("db_system_name", "db_operation_name")
        self.metrics: list[Any] = [
            operations := p.Counter(
                "oncely_operations",
                "Protected operations, by how their claim was answered.",
                operation,
                registry=registry,
            ),
            durations := p.Histogram(
                "oncely_operation_duration_seconds",
                "How long protected operations took, from start to settle.",
                operation,
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            store_durations := p.Histogram(
                "oncely_store_operation_duration_seconds",
                "How long the store verbs oncely calls took.",
                store,
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            store_errors := p.Counter(
                "oncely_store_errors",
                "Store verbs that raised, by error type.",
                (*store, "error_type"),
                registry=registry,
            ),
            lost := p.Counter(
                "oncely_lease_lost",
                "Leases found taken over, by heartbeat or when settling.",
                ("operation", "during"),
                registry=registry,
            ),
            beats := p.Counter(
                "oncely_heartbeats",
                "Heartbeat extends, by result (ok, failed).",
                ("operation", "result"),
                registry=registry,
            ),
            verdicts := p.Counter(
                "oncely_consumer_verdicts",
                "Consumer verdicts, by action and reason.",
                ("operation", "action", "reason"),
                registry=registry,
            ),
            dead := p.Counter(
                "oncely_dead_letters",
                "Messages and outbox events given up on.",
                ("surface", "operation", "reason"),
                registry=registry,
            ),
            written := p.Counter(
                "oncely_outbox_written",
                "Events added to the outbox.",
                ("destination",),
                registry=registry,
            ),
            published := p.Counter(
                "oncely_outbox_published",
                "Outbox publish attempts, by result (published, failed).",
                ("destination", "result"),
                registry=registry,
            ),
            pending := p.Gauge(
                "oncely_outbox_pending",
                "Outbox events committed and not yet published.",
                registry=registry,
            ),
            dead_events := p.Gauge(
                "oncely_outbox_dead",
                "Outbox events the relay gave up on.",
                registry=registry,
            ),
            oldest := p.Gauge(
                "oncely_outbox_oldest_pending_age_seconds",
                "Age of the oldest unpublished outbox event: the relay's lag.",
                registry=registry,
            ),
        ]

        # The labelled children of the per-call series, kept: `labels()` costs a lock and a
        # validation per call.
        counted: dict[tuple[str, ...], Any] = {}
        timed: dict[tuple[str, ...], Any] = {}
        verbs: dict[tuple[str, str], Any] = {}

        def on_event(event: _events.Event) -> None:
            if isinstance(event, _events.Operation):
                labels = (event.surface, event.operation, event.store, event.outcome)
                counter = counted.get(labels)
                if counter is None:
                    counter = counted[labels] = operations.labels(*labels)
                counter.inc()
                if event.duration is not None:
                    histogram = timed.get(labels)
                    if histogram is None:
                        histogram = timed[labels] = durations.labels(*labels)
                    histogram.observe(event.duration)
            elif isinstance(event, _events.StoreCall):
                verb = verbs.get((event.store, event.verb))
                if verb is None:
                    system = _db_system(event.store)
                    verb = verbs[event.store, event.verb] = store_durations.labels(
                        system, event.verb
                    )
                verb.observe(event.duration)
                if event.error is not None:
                    system = _db_system(event.store)
                    store_errors.labels(system, event.verb, event.error).inc()
            elif isinstance(event, _events.LeaseLost):
                lost.labels(event.operation, event.during).inc()
            elif isinstance(event, _events.Heartbeat):
                beats.labels(event.operation, "ok" if event.ok else "failed").inc()
            elif isinstance(event, _events.Verdict):
                verdicts.labels(event.operation, event.action, event.reason).inc()
            elif isinstance(event, _events.DeadLetter):
                dead.labels(event.surface, event.operation, event.reason).inc()
            elif isinstance(event, _events.OutboxWritten):
                written.labels(event.destination).inc()
            elif isinstance(event, _events.OutboxPublished):
                result = "published" if event.error is None else "failed"
                published.labels(event.destination, result).inc()
            elif isinstance(event, _events.OutboxBacklog):
                pending.set(event.pending)
                dead_events.set(event.dead)
                oldest.set(event.oldest_age or 0.0)

        self._unsubscribe = _events.subscribe(on_event)

    def close(self) -> None:
        self._unsubscribe()
        for metric in self.metrics:
            with contextlib.suppress(KeyError):  # unregistered by the application already
                self.registry.unregister(metric)


def _db_system(store: str) -> str:
    """The ``db.system.name`` of a store backend (OpenTelemetry's well-known values)."""
    return _DB_SYSTEMS.get(store, store)


_DB_SYSTEMS = {"postgres": "postgresql"}
