"""The decorator's own cost on ``memory://``: beside a dict-based reference, in calls and stages.

Run by ``bench_stores.py`` (its ``memory://`` section), one child process per source tree and
round, so that two oncely trees (this one, and a ``--baseline`` one) can be measured in the
same run, interleaved:

    PYTHONPATH=src python benchmarks/stores/hotpath.py --ops 2000 --stages   # one round, JSON

Each round times, interleaved in a rotating order, the payment function of the store benchmark
decorated by oncely's ``@idempotent`` (``memory://``, default policy) and by `reference`, the
25-line dict-based decorator of the hot-path issue: sync and async, a first call per key (new
key) then a second (replay). It counts the Python function calls (and the C calls) of one
decorated call with ``sys.setprofile``, and with ``--stages`` times the stages of the straight
line that a decorated call runs (`stages`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import hashlib
import inspect
import itertools
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

LEASE_S = 30
TTL_S = 300


def reference(key: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The dict-based idempotent decorator of the hot-path issue: it binds the signature,
    fingerprints the arguments with JSON and SHA-256, and keeps records in a dict under a lock
    (an in-progress marker while the function runs, then the result as JSON)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        records: dict[str, tuple[str, str | None]] = {}
        lock = threading.Lock()

        def begin(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str, str | None]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            text = json.dumps(bound.arguments, sort_keys=True, separators=(",", ":"))
            fingerprint = hashlib.sha256(text.encode()).hexdigest()
            name, mine = str(bound.arguments[key]), (fingerprint, None)
            with lock:
                found = records.setdefault(name, mine)
            if found is not mine and found[0] != fingerprint:
                raise ValueError(f"key {name!r} reused with other arguments")
            if found is not mine and found[1] is None:
                raise RuntimeError(f"key {name!r} is in progress")
            return name, fingerprint, None if found is mine else found[1]

        def end(name: str, fingerprint: str, result: Any) -> Any:
            with lock:
                records[name] = (fingerprint, json.dumps(result))
            return result

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name, fingerprint, stored = begin(args, kwargs)
            if stored is not None:
                return json.loads(stored)
            return end(name, fingerprint, fn(*args, **kwargs))

        @functools.wraps(fn)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            name, fingerprint, stored = begin(args, kwargs)
            if stored is not None:
                return json.loads(stored)
            return end(name, fingerprint, await fn(*args, **kwargs))

        return awrapper if inspect.iscoroutinefunction(fn) else wrapper

    return decorate


# -- the subjects ------------------------------------------------------------------------------


def _payment(payment_id: str, amount_cents: int) -> dict[str, Any]:
    return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}


async def _apayment(payment_id: str, amount_cents: int) -> dict[str, Any]:
    return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}


def subjects() -> dict[str, tuple[Callable[..., Any], Callable[..., Awaitable[Any]]]]:
    """Name -> (sync, async) decorated payment function."""
    import oncely

    store = oncely.open_store("memory://")
    options: dict[str, Any] = {"store": store, "key": "payment_id", "ttl": TTL_S, "lease": LEASE_S}
    return {
        "reference": (reference("payment_id")(_payment), reference("payment_id")(_apayment)),
        "oncely": (oncely.idempotent(**options)(_payment), oncely.idempotent(**options)(_apayment)),
    }


# -- timing ------------------------------------------------------------------------------------


def _time_sync(call: Callable[..., Any], keys: list[str]) -> float:
    """Microseconds per call of ``call(key, 1250)`` over *keys* (from a collected heap: the
    records the subjects keep would otherwise make the collector's full passes, which fall on
    whichever subject runs, ever longer)."""
    gc.collect()
    started = time.perf_counter()
    for key in keys:
        call(key, 1250)
    return (time.perf_counter() - started) / len(keys) * 1e6


async def _time_async(call: Callable[..., Awaitable[Any]], keys: list[str]) -> float:
    gc.collect()
    started = time.perf_counter()
    for key in keys:
        await call(key, 1250)
    return (time.perf_counter() - started) / len(keys) * 1e6


def one_round(ops: int, turn: int) -> dict[str, float]:
    """``{"<subject> <sync|async> <new|replay>": µs per call}`` of one round: each subject's new
    keys then their replays, subjects in an order that rotates with *turn*."""
    found = subjects()
    names = sorted(found)
    names = names[turn % len(names) :] + names[: turn % len(names)]
    run = uuid.uuid4().hex[:8]
    figures: dict[str, float] = {}
    loop = asyncio.new_event_loop()
    try:
        for warm in (True, False):
            for name in names:
                sync, async_ = found[name]
                keys = [f"{run}-{name}-{warm}-s{index}" for index in range(ops)]
                akeys = [f"{run}-{name}-{warm}-a{index}" for index in range(ops)]
                times = {
                    "sync new": _time_sync(sync, keys),
                    "sync replay": _time_sync(sync, keys),
                    "async new": loop.run_until_complete(_time_async(async_, akeys)),
                    "async replay": loop.run_until_complete(_time_async(async_, akeys)),
                }
                if not warm:
                    figures.update({f"{name} {what}": value for what, value in times.items()})
    finally:
        loop.close()
    return figures


# -- counting calls ----------------------------------------------------------------------------


class Counts:
    """A ``sys.setprofile`` function counting Python function calls (a generator resumed counts
    as one) and C calls."""

    def __init__(self) -> None:
        self.python = 0
        self.c = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.python += 1
        elif event == "c_call":
            self.c += 1

    def result(self) -> list[int]:
        return [self.python, self.c - 1]  # the setprofile(None) that ends the count


def count_calls(call: Callable[[], Any]) -> list[int]:
    """[Python calls, C calls] made while *call* runs."""
    counts = Counts()
    sys.setprofile(counts)
    try:
        call()
    finally:
        sys.setprofile(None)
    return counts.result()


async def acount_calls(call: Callable[[], Awaitable[Any]]) -> list[int]:
    """[Python calls, C calls] made while *call* is awaited, the event loop's included (it
    runs in this thread while the call is suspended)."""
    counts = Counts()
    sys.setprofile(counts)
    try:
        await call()
    finally:
        sys.setprofile(None)
    return counts.result()


def calls_per_call(tries: int = 3) -> dict[str, list[int]]:
    """``{"<sync|async> <new|replay>": [python calls, C calls]}`` of one oncely decorated call
    (the decorated function's own call included) on ``memory://``: the fewest over *tries*
    calls, since a new lease may find the heartbeat thread waiting and wake it (a few calls of
    ``threading.Condition`` that depend on that thread's timing, not on the call's path)."""
    sync, async_ = subjects()["oncely"]
    loop = asyncio.new_event_loop()

    def fewest(counted: list[list[int]]) -> list[int]:
        return min(counted)

    try:
        for index in range(50):  # warm: first-call caches, the heartbeat thread
            sync(f"warm-{index}", 1250)
            sync(f"warm-{index}", 1250)
            loop.run_until_complete(async_(f"awarm-{index}", 1250))
            loop.run_until_complete(async_(f"awarm-{index}", 1250))
        new, replay, anew, areplay = [], [], [], []
        for index in range(tries):
            key, akey = f"count-{index}", f"acount-{index}"
            new.append(count_calls(lambda key=key: sync(key, 1250)))
            replay.append(count_calls(lambda key=key: sync(key, 1250)))
            anew.append(loop.run_until_complete(acount_calls(lambda akey=akey: async_(akey, 1250))))
            areplay.append(
                loop.run_until_complete(acount_calls(lambda akey=akey: async_(akey, 1250)))
            )
        return {
            "sync new": fewest(new),
            "sync replay": fewest(replay),
            "async new": fewest(anew),
            "async replay": fewest(areplay),
        }
    finally:
        loop.close()


# -- stages ------------------------------------------------------------------------------------


STAGES = {
    "new": [
        ("arguments", "the key and fingerprint of the arguments (`_CallPlan.invocation`)"),
        ("claim", "the store's claim (a new key: the lease; a replay: the record)"),
        ("lease", "the lease, and the heartbeat started and stopped"),
        ("run", "the function itself, under `current_lease`"),
        ("encode", "the result encoded and framed (`outcome_of`)"),
        ("complete", "the store's complete"),
    ],
    "replay": [
        ("arguments", "the key and fingerprint of the arguments (`_CallPlan.invocation`)"),
        ("claim", "the store's claim (a new key: the lease; a replay: the record)"),
        ("decode", "the duplicate logged, the stored value decoded (`suppressed`, `replay`)"),
    ],
}
"""The stages of the straight line (`oncely._execution.call`) a decorated call runs."""


def stages(ops: int) -> dict[str, float]:
    """``{"<sync|async> <new|replay> <stage>": µs per call}``, and ``... total``: the steps of
    `oncely._execution.call` / ``acall`` run one by one with a clock read between them (the
    whole decorated call is timed apart, in `one_round`)."""
    from oncely import _execution
    from oncely._execution.heartbeat import SCHEDULER

    sync, async_ = subjects()["oncely"]
    plan = sync._oncely_plan  # type: ignore[attr-defined]
    aplan = async_._oncely_plan  # type: ignore[attr-defined]
    clock = time.perf_counter_ns
    spent: dict[str, list[int]] = {}

    def add(prefix: str, marks: list[tuple[str, int]]) -> None:
        call: dict[str, int] = {"total": marks[-1][1] - marks[0][1]}
        for (_, before), (name, after) in itertools.pairwise(marks):
            call[name] = call.get(name, 0) + after - before  # the lease comes twice
        for name, value in call.items():
            spent.setdefault(f"{prefix} {name}", []).append(value)

    def sync_call(key: str) -> None:
        policy, store = plan.policy, plan.store
        marks = [("", clock())]
        _, scoped, fingerprint, *_ = plan.invocation((key, 1250), {}, None)
        marks.append(("arguments", clock()))
        answer = store.claim(scoped, fingerprint, lease=policy.lease, ttl=policy.ttl)
        marks.append(("claim", clock()))
        if isinstance(answer, oncely_records.Replay):
            _execution.suppressed(scoped, answer)
            _execution.replay(answer, plan.codec, plan.annotation, policy)
            marks.append(("decode", clock()))
            return add("sync replay", marks)
        lease = _execution.acquired(scoped, answer, policy)
        lease.heartbeat = SCHEDULER.start(store, lease)  # as `call` does
        marks.append(("lease", clock()))
        value = _execution.invoke_under(lease, lambda: plan.fn(key, 1250))
        marks.append(("run", clock()))
        payload = _execution.outcome_of(lease, value, plan.codec)
        marks.append(("encode", clock()))
        lease.settling = True
        store.complete(scoped, lease.token, payload, ttl=policy.ttl)
        marks.append(("complete", clock()))
        SCHEDULER.stop(lease)
        marks.append(("lease", clock()))
        return add("sync new", marks)

    async def async_call(key: str) -> None:
        policy, store = aplan.policy, aplan.store
        marks = [("", clock())]
        _, scoped, fingerprint, *_ = aplan.invocation((key, 1250), {}, None)
        marks.append(("arguments", clock()))
        answer = await store.aclaim(scoped, fingerprint, lease=policy.lease, ttl=policy.ttl)
        marks.append(("claim", clock()))
        if isinstance(answer, oncely_records.Replay):
            _execution.suppressed(scoped, answer)
            _execution.replay(answer, aplan.codec, aplan.annotation, policy)
            marks.append(("decode", clock()))
            return add("async replay", marks)
        lease = _execution.acquired(scoped, answer, policy)
        _execution.start_async_heartbeat(store, lease)
        marks.append(("lease", clock()))
        value = await _execution.ainvoke_under(lease, lambda: aplan.fn(key, 1250))
        marks.append(("run", clock()))
        payload = _execution.outcome_of(lease, value, aplan.codec)
        marks.append(("encode", clock()))
        lease.settling = True
        await store.acomplete(scoped, lease.token, payload, ttl=policy.ttl)
        marks.append(("complete", clock()))
        _execution.stop_async_heartbeat(lease)  # the task never starts: nothing to await
        marks.append(("lease", clock()))
        return add("async new", marks)

    from oncely._core import records as oncely_records

    run = uuid.uuid4().hex[:8]
    loop = asyncio.new_event_loop()
    try:
        for warm in (True, False):
            if not warm:
                spent.clear()
            keys = [f"{run}-{warm}-{index}" for index in range(ops)]
            for key in keys + keys:
                sync_call(key)
            for key in keys + keys:
                loop.run_until_complete(async_call("a" + key))
    finally:
        loop.close()
    return {name: statistics.median(values) / 1000 for name, values in spent.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="one round of the memory:// decorator figures")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--turn", type=int, default=0, help="rotates the subjects' order")
    parser.add_argument("--calls", action="store_true", help="also the calls per call")
    parser.add_argument("--stages", action="store_true", help="also the stages (this tree)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"round": one_round(args.ops, args.turn)}
    if args.calls:
        out["calls"] = calls_per_call()
    if args.stages:
        out["stages"] = stages(args.ops)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
