"""Sans-I/O flows: logic written once as a generator, run by a sync or an async driver.

A flow yields operations (store calls, "invoke the user's function", "sleep") and receives their
results; an exception raised while performing an operation is thrown back into the flow at the
point that yielded it. `drive` and `adrive` are the reference drivers: a flow is the same for sync
and async callers, only its driver differs.

Some entry points run copies of a flow written out for speed (`oncely._execution`: the
decorator's `call` and `acall` write out its common paths, and `arun` awaits a store call
without `aperform` around it). `oncely._switches.reference_flows` makes each of them run the
flow through these drivers and `perform`/`aperform` instead, and the test suite runs the entry
points both ways (``pytest --reference-flows``), so a copy that drifts from its flow fails the
same tests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeAlias, TypeVar

__all__ = ["Flow", "adrive", "drive"]

T = TypeVar("T")

Flow: TypeAlias = Generator[Any, Any, T]
"""Yields operations to perform, receives their results, returns the outcome."""


def drive(flow: Flow[T], perform: Callable[[Any], Any]) -> T:
    """Run *flow* to completion, performing each operation it yields synchronously."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.throw(error) if error is not None else flow.send(send)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            send, error = perform(op), None
        except BaseException as exc:  # the flow decides: release the lease, map the error...
            send, error = None, exc


async def adrive(flow: Flow[T], perform: Callable[[Any], Awaitable[Any]]) -> T:
    """Run *flow* to completion, awaiting each operation it yields."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.throw(error) if error is not None else flow.send(send)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            send, error = await perform(op), None
        except BaseException as exc:
            send, error = None, exc
