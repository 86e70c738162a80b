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


def test_a_batch_delivery_spans_its_handler_and_times_it(sinks: Sinks) -> None:
    """A batch's deliveries are decided together, after every handler ran: each one's span and
    duration are its own handler's run, not the moment the batch was decided."""
    import time

    import oncely
    from oncely.consumers import Delivery, IdempotentConsumer

    consumer = IdempotentConsumer(oncely.open_store("memory://"), scope="obs-batch")

    def handler(raw: str) -> None:
        time.sleep(0.05 if raw == "slow" else 0)

    deliveries = [
        Delivery(b"{}", {"Idempotency-Key": name}, None, name) for name in ("slow", "fast")
    ]
    before = time.time_ns()
    verdicts = consumer.process_batch(deliveries, handler)
    assert [v.reason.value for v in verdicts] == ["processed", "processed"]
    durations = sorted(
        (span.end_time or 0) - (span.start_time or 0)
        for span in sinks.finished("process obs-batch")
    )
    assert len(durations) == 2
    assert durations[-1] >= 50_000_000  # the slow handler's run
    assert durations[0] < 50_000_000  # the fast one's, not the batch's
    assert all((span.start_time or 0) >= before for span in sinks.finished("process obs-batch"))
    timed = [event.duration for event in sinks.operations(surface="consumer")]
    assert len(timed) == 2
    assert all(duration is not None for duration in timed)
    assert max(d for d in timed if d is not None) >= 0.05
