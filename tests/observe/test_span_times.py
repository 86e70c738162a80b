"""An operation reported after the fact (a batch's delivery, decided once the whole batch ran)
carries its own start and end: its span covers them instead of lasting no time."""

from __future__ import annotations

from oncely import _events
from tests.observe.conftest import Sinks

START = 1_800_000_000_000_000_000
END = START + 250_000_000


def test_a_delivery_reported_after_the_fact_spans_its_own_run(sinks: Sinks) -> None:
    handle = _events.Handle()
    _events.emit(_events.Started("consumer", "billing", "memory", handle, "orders", start_ns=START))
    _events.emit(
        _events.Operation(
            "consumer",
            "billing",
            "memory",
            "acquired",
            None,
            detail="processed",
            handle=handle,
            end_ns=END,
        )
    )
    (span,) = sinks.finished("process orders")
    assert (span.start_time, span.end_time) == (START, END)
    assert span.attributes["oncely.outcome"] == "acquired"


def test_without_times_a_span_starts_and_ends_when_reported(sinks: Sinks) -> None:
    handle = _events.Handle()
    _events.emit(_events.Started("function", "pay", "memory", handle))
    _events.emit(_events.Operation("function", "pay", "memory", "acquired", 0.1, handle=handle))
    (span,) = sinks.finished("oncely pay")
    assert span.start_time is not None
    assert span.end_time is not None
    assert span.end_time >= span.start_time > 0
    assert span.start_time != START
