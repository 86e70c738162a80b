"""The straight line: `call` and `acall`, what a decorated call runs.

`call` and `acall` are `protected_call` run by `run` and `arun`, written out for the two common
cases: a claim that acquires, a run, a complete that lands; and a claim that replays. Every
decision is a helper the flows share (`acquired`, `suppressed`, `replay`, `outcome_of`); any other
answer or error goes on in the flows, from the point reached. With
`oncely._switches.reference_flows` set, both run the flow itself, so that the tests hold the two
to the same behaviour.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from oncely import _switches
from oncely._cancel import guards_itself, shielded
from oncely._core import codec as _codec
from oncely._core.policy import Policy
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._core.records import Acquired, Replay
from oncely._execution.drivers import aclaim, arun, run
from oncely._execution.flows import (
    acquired,
    outcome_of,
    protected_call,
    raise_if_unstorable,
    replay,
    settle,
    settle_error,
    suppressed,
)
from oncely._execution.heartbeat import SCHEDULER, start_async_heartbeat, stop_async_heartbeat
from oncely._execution.lease import ainvoke_under, invoke_under

__all__ = ["acall", "call"]

T = TypeVar("T")


def call(
    store: SyncStore,
    key: str,
    fingerprint: str,
    policy: Policy,
    codec: _codec.Codec,
    annotation: Any,
    invoke: Callable[[], T],
) -> T:
    """``run(protected_call(...), store, invoke)``, with no flow on the common paths."""
    if _switches.reference_flows:
        flow = protected_call(key, fingerprint, policy, codec, annotation)
        return run(flow, store, invoke)  # type: ignore[no-any-return]
    answer = store.claim(key, fingerprint, lease=policy.lease, ttl=policy.ttl)
    if type(answer) is Replay:
        suppressed(key, answer)
        return replay(answer, codec, annotation, policy)  # type: ignore[no-any-return]
    if type(answer) is not Acquired:
        flow = protected_call(key, fingerprint, policy, codec, annotation, answer)
        return run(flow, store, invoke)  # type: ignore[no-any-return]
    lease = acquired(key, answer, policy)
    if policy.heartbeat:
        lease.heartbeat = SCHEDULER.start(store, lease)
    try:
        value = invoke_under(lease, invoke)
    except BaseException as exc:
        run(settle_error(lease, exc, policy), store)
        raise
    if lease.committed:  # completed in its own transaction: `settle` only stops the heartbeat
        run(settle(lease, "complete", None, policy), store)
        if lease.unstorable is not None:
            raise_if_unstorable(lease)
        return value
    payload = outcome_of(lease, value, codec)
    lease.settling = True
    try:
        lost = store.complete(key, lease.token, payload, ttl=policy.ttl)
    except BaseException as exc:
        run(settle(lease, "complete", payload, policy, (None, exc)), store)
    else:
        if lost is not None:
            run(settle(lease, "complete", payload, policy, (lost, None)), store)
        elif lease.heartbeat is not None:
            SCHEDULER.stop(lease)
    if lease.unstorable is not None:
        raise_if_unstorable(lease)
    return value


async def acall(
    store: AsyncStore,
    key: str,
    fingerprint: str,
    policy: Policy,
    codec: _codec.Codec,
    annotation: Any,
    invoke: Callable[[], Awaitable[T]],
) -> T:
    """``await arun(protected_call(...), store, invoke)``, with no flow on the common paths."""
    if _switches.reference_flows:
        flow = protected_call(key, fingerprint, policy, codec, annotation)
        return await arun(flow, store, invoke)
    answer = await aclaim(store, key, fingerprint, lease=policy.lease, ttl=policy.ttl)
    if type(answer) is Replay:
        suppressed(key, answer)
        return replay(answer, codec, annotation, policy)  # type: ignore[no-any-return]
    if type(answer) is not Acquired:
        flow = protected_call(key, fingerprint, policy, codec, annotation, answer)
        return await arun(flow, store, invoke)
    lease = acquired(key, answer, policy)
    if policy.heartbeat:
        start_async_heartbeat(store, lease)
    try:
        value = await ainvoke_under(lease, invoke)
    except BaseException as exc:
        await arun(settle_error(lease, exc, policy), store)
        raise
    if lease.committed:  # completed in its own transaction: `settle` only stops the heartbeat
        await arun(settle(lease, "complete", None, policy), store)
        if lease.unstorable is not None:
            raise_if_unstorable(lease)
        return value
    payload = outcome_of(lease, value, codec)
    lease.settling = True
    try:  # the operation ran: a cancelled caller still records its outcome
        completing = store.acomplete(key, lease.token, payload, ttl=policy.ttl)
        if not guards_itself(store):
            completing = shielded(completing)
        lost = await completing
    except BaseException as exc:
        await arun(settle(lease, "complete", payload, policy, (None, exc)), store)
    else:
        if lost is not None:
            await arun(settle(lease, "complete", payload, policy, (lost, None)), store)
        elif lease.heartbeat is not None:
            started = stop_async_heartbeat(lease)
            if started is not None:
                await asyncio.wait((started,))
    if lease.unstorable is not None:
        raise_if_unstorable(lease)
    return value
