"""The drivers: `run` and `arun` perform a flow's operations against a sync or async store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from oncely import _events, _observed, _switches
from oncely._cancel import given_back_if_cancelled, guards_itself, shielded
from oncely._core.flow import Flow, adrive, drive
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._core.records import ClaimResult
from oncely._execution.heartbeat import SCHEDULER, start_async_heartbeat, stop_async_heartbeat
from oncely._execution.lease import ainvoke_under, invoke_under
from oncely._execution.ops import Invoke, Sleep, StartHeartbeat, StopHeartbeat, StoreCall

__all__ = ["aclaim", "aperform", "arun", "perform", "run"]

T = TypeVar("T")


def run(flow: Flow[T], store: SyncStore, invoke: Callable[[], Any] | None = None) -> T:
    """Run *flow* against a sync store; *invoke* runs the protected function."""
    return drive(flow, lambda op: perform(op, store, invoke))


def perform(op: Any, store: SyncStore, invoke: Callable[[], Any] | None = None) -> Any:
    """Perform one operation of a flow against a sync store (what `run` does with each)."""
    if _events.on:
        store = _observed.timed(store)
    kind = type(op)
    if kind is StoreCall:
        return getattr(store, op.verb)(*op.args, **op.kwargs)
    if kind is Invoke and invoke is not None:
        return invoke_under(op.lease, invoke)
    if kind is StartHeartbeat:
        op.state.heartbeat = SCHEDULER.start(store, op.state)
        return None
    if kind is StopHeartbeat:
        SCHEDULER.stop(op.state)
        return None
    if kind is Sleep:
        time.sleep(op.seconds)
        return None
    raise TypeError(f"cannot perform {op!r}")


async def arun(
    flow: Flow[T], store: AsyncStore, invoke: Callable[[], Awaitable[Any]] | None = None
) -> T:
    """Run *flow* against an async store; *invoke* runs the protected coroutine function."""
    if _switches.reference_flows:
        return await adrive(flow, lambda op: aperform(op, store, invoke))
    if _events.on:
        store = _observed.timed(store)

    def perform(op: Any) -> Awaitable[Any]:
        # A store call (most operations) is awaited as the store's own awaitable: no coroutine
        # of `aperform` around it.
        if type(op) is StoreCall:
            return _astore_call(op, store)
        return aperform(op, store, invoke)

    return await adrive(flow, perform)


async def aperform(
    op: Any, store: AsyncStore, invoke: Callable[[], Awaitable[Any]] | None = None
) -> Any:
    """Perform one operation of a flow against an async store (what `arun` does with each)."""
    if _events.on:
        store = _observed.timed(store)
    kind = type(op)
    if kind is StoreCall:
        return await _astore_call(op, store)
    if kind is Invoke and invoke is not None:
        return await ainvoke_under(op.lease, invoke)
    if kind is StartHeartbeat:
        start_async_heartbeat(store, op.state)
        return None
    if kind is StopHeartbeat:
        started = stop_async_heartbeat(op.state)
        if started is not None:
            await asyncio.wait((started,))
        return None
    if kind is Sleep:
        await asyncio.sleep(op.seconds)
        return None
    raise TypeError(f"cannot perform {op!r}")


_GUARDED_VERBS = frozenset({"claim", "complete", "fail"})
"""The verbs a store that `guards_itself` answers safely to a cancelled caller."""


def _astore_call(op: StoreCall, store: AsyncStore) -> Awaitable[Any]:
    call = getattr(store, "a" + op.verb)(*op.args, **op.kwargs)
    if op.verb in _GUARDED_VERBS and guards_itself(store):
        return call  # type: ignore[no-any-return]
    if op.shield:
        return shielded(call)
    if op.verb == "claim":
        return given_back_if_cancelled(call, store, op.args[0])
    if op.verb == "claim_many":
        return given_back_if_cancelled(call, store, [key for key, _ in op.args[0]])
    return call  # type: ignore[no-any-return]


def aclaim(
    store: AsyncStore, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
) -> Awaitable[ClaimResult]:
    """``store.aclaim(...)``, whose lease is given back if the caller is cancelled meanwhile
    (see `given_back_if_cancelled`): to await. The store's own awaitable when it gives its
    lease back itself (no coroutine of this function's around it)."""
    call = store.aclaim(key, fingerprint, lease=lease, ttl=ttl)
    if guards_itself(store):
        return call  # no claim in flight, or the store gives its lease back itself
    return given_back_if_cancelled(call, store, key)
