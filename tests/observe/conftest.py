"""Both exporters installed against fresh sinks: a Prometheus registry, in-memory OTel readers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

import oncely.observe
from oncely.observe import otel, prometheus


@dataclass
class Sinks:
    registry: CollectorRegistry
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter
    tracer_provider: TracerProvider
    events: list[oncely.observe.Event]
    points: dict[tuple[str, tuple[tuple[str, Any], ...]], float] = field(default_factory=dict)

    def prom(self, name: str, **labels: str) -> float:
        """A Prometheus sample's value (0 when absent)."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def otel(self, name: str, **attributes: Any) -> float:
        """The sum (counter) or count (histogram) of an OTel metric's points with *attributes*.

        Every point collected is kept until a later collection updates it: the SDK's early
        releases (1.20, the otel extra's floor) leave out of a cumulative collection the
        histogram points that took no measurement since the one before.
        """
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None) or getattr(point, "count", 0)
                        labels = tuple(sorted(point.attributes.items()))
                        self.points[(metric.name, labels)] = value
        return sum(
            value
            for (metric, labels), value in self.points.items()
            if metric == name and all(dict(labels).get(k) == v for k, v in attributes.items())
        )

    def finished(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]

    def operations(self, **fields: Any) -> list[oncely.observe.Operation]:
        return [
            event
            for event in self.events
            if isinstance(event, oncely.observe.Operation)
            and all(getattr(event, k) == v for k, v in fields.items())
        ]


@pytest.fixture
def sinks() -> Iterator[Sinks]:
    registry = CollectorRegistry()
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    events: list[oncely.observe.Event] = []
    unsubscribe = oncely.observe.subscribe(events.append)
    remove_prometheus = prometheus.install(registry)
    remove_otel = otel.install(meter_provider, tracer_provider)
    try:
        yield Sinks(registry, reader, spans, tracer_provider, events)
    finally:
        remove_otel()
        remove_prometheus()
        unsubscribe()
        meter_provider.shutdown()
        tracer_provider.shutdown()
