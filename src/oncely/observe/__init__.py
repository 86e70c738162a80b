"""See what oncely does: one event stream from every entry point, and exporters for it.

Every entry point (``@idempotent``, `oncely.Guard`, the HTTP middleware and the httpx
transport, each consumer, the inbox, the outbox writer and relay) reports what happened as a
typed, frozen event. `subscribe` hands them to your callback; `oncely.observe.prometheus` and
`oncely.observe.otel` turn them into metrics and spans; `record_activity` counts replays,
duplicates, mismatches and refusals into the store, where the dashboard (and `read_activity`)
sees every process's. With nothing subscribed, nothing is built: an unobserved process pays one
flag check per entry point.

.. code-block:: python

    import oncely.observe

    def on_event(event: oncely.observe.Event) -> None:
        if isinstance(event, oncely.observe.Operation) and event.outcome == "replayed":
            print("replayed", event.operation, event.token)

    unsubscribe = oncely.observe.subscribe(on_event)

A callback runs synchronously, in the thread and context of the operation, before the
operation returns to its caller: so a caller can tell whether *its* call was replayed (see
`replayed`). A callback that raises is logged once and never breaks the operation.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from oncely._events import (
    DeadLetter,
    Event,
    Handle,
    Heartbeat,
    LeaseLost,
    Operation,
    OutboxBacklog,
    OutboxPublished,
    OutboxWritten,
    Outcome,
    Started,
    StoreCall,
    Surface,
    Verdict,
    subscribe,
)
from oncely.observe.activity import (
    Activity,
    ActivityRecorder,
    migrate_activity,
    read_activity,
    record_activity,
)

__all__ = [
    "Activity",
    "ActivityRecorder",
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
    "migrate_activity",
    "outcomes",
    "read_activity",
    "record_activity",
    "subscribe",
]

_COLLECTING: contextvars.ContextVar[list[Operation] | None] = contextvars.ContextVar(
    "oncely_collecting", default=None
)


@contextlib.contextmanager
def outcomes() -> Iterator[list[Operation]]:
    """Collect the `Operation` events reported in this context while the block runs.

    The way to know whether a decorated call was replayed (or recovered, or refused), without
    wrapping the function:

    .. code-block:: python

        with oncely.observe.outcomes() as seen:
            receipt = charge(payment_id="p-1", amount_cents=500)
        if seen[-1].outcome == "replayed":
            response.headers["Idempotent-Replayed"] = "true"

    Only operations of this thread or task (and the tasks it starts) are collected.
    """
    collected: list[Operation] = []
    token = _COLLECTING.set(collected)
    unsubscribe = subscribe(_collect)
    try:
        yield collected
    finally:
        unsubscribe()
        _COLLECTING.reset(token)


def _collect(event: Event) -> None:
    if type(event) is Operation:
        collected = _COLLECTING.get()
        if collected is not None:
            collected.append(event)
