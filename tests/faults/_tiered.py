"""Histories of tiered caches in several processes, with records forgotten and purged between
attempts (the ``caches`` entry point).

Three worker processes each open their own ``tiered+<url>`` store (over Redis for the ``tiered``
store, PostgreSQL, or SQLite) with a cache bound `MAX_STALENESS`, and claim the same keys again
and again: a claim that acquires runs (its result names the run), a replay is an answer. Between
their attempts the campaign forgets the keys and runs them again at once through a store of its
own, with no cache (``forget``; the first forget is ``oncely forget``'s), or lets them expire
and purges them, forgetting some too (``purge``). Each worker runs again what it finds gone.

A result stops being the key's once a forget that started after it was stored has returned, or
once its ttl has passed since it was stored. The checker reports an answer given from a claim
sent later than that plus the bound (and a little slack for the pipes and the loaded machine):

- ``stale_replay``: a forgotten or expired result was replayed past the bound;
- ``split_answer``: the same, after another process had already answered the key's newer
  result (two hosts answering one key differently).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import random
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import oncely
from tests.faults._checker import Anomaly
from tests.faults._history import History, now

if TYPE_CHECKING:
    from tests.faults._campaign import Plan, Result, Services

ENTRY = "caches"
STORES = ("tiered", "postgres", "sqlite")
FAULTS = ("forget", "purge")
KINDS = ("stale_replay", "split_answer")

MAX_STALENESS = 0.4
"""The cache bound of the workers' tiered stores, in seconds."""
SLACK = 0.3
"""Seconds an answer's claim may be sent past a result's end plus the bound without being
judged: the events cross pipes from processes a loaded machine schedules late."""
ROUNDS = 2
"""Forgets (or purges) per history: the first key's first forget is ``oncely forget``'s."""
PURGE_TTL = 1.3
"""The record ttl of a ``purge`` history: long enough to be cached (a cached record is dropped
a second before it expires), short enough to expire between rounds."""
WORKERS = ("A", "B", "C")


def applicable(store: str, entry: str, fault: str) -> bool | None:
    """Whether the ``caches`` histories cover *store* x *entry* x *fault*; None when neither
    the entry nor the fault is theirs."""
    if entry == ENTRY or fault in FAULTS:
        return entry == ENTRY and store in STORES and fault in FAULTS
    return None


def _url(plan: Plan, services: Services) -> str:
    if plan.store == "postgres":
        return services.pg_store_url
    if plan.store == "sqlite":
        return f"sqlite:///{services.tmp}/h{plan.index}.db"
    assert services.redis is not None
    return f"redis://127.0.0.1:{services.redis.port}/0"


# -- the worker processes --------------------------------------------------------------------


def worker(config: dict[str, Any], pipe: Any) -> None:
    """Claim every key in turn until told to stop; report runs and answers; close the pipe.
    Worker ``B`` uses the async verbs."""
    store = oncely.open_store(
        "tiered+" + config["url"],
        namespace=config["namespace"],
        max_staleness=timedelta(seconds=MAX_STALENESS),
    )
    lease, ttl = timedelta(seconds=30), timedelta(seconds=config["ttl"])
    name, stop = config["worker"], config["stop"]
    runs = 0

    def answer(key: str, sent: float, claimed: Any) -> Any:
        nonlocal runs
        if isinstance(claimed, oncely.Acquired):
            runs += 1
            value = f"{name}{runs}"
            pipe.send({"ev": "run", "worker": name, "key": key, "value": value, "t": sent})
            return value
        if isinstance(claimed, oncely.Replay):
            value = (claimed.record.result or b"").decode()
            pipe.send({"ev": "answer", "worker": name, "key": key, "value": value, "t": sent})
        return None

    def stored(key: str, value: str) -> None:
        pipe.send({"ev": "stored", "worker": name, "key": key, "value": value, "t": now()})

    async def arun(key: str) -> None:
        sent = now()
        claimed = await store.aclaim(key, "fp", lease=lease, ttl=ttl)
        value = answer(key, sent, claimed)
        if value is not None:
            assert isinstance(claimed, oncely.Acquired)
            assert await store.acomplete(key, claimed.token, value.encode(), ttl=ttl) is None
            stored(key, value)

    def run(key: str) -> None:
        sent = now()
        claimed = store.claim(key, "fp", lease=lease, ttl=ttl)
        value = answer(key, sent, claimed)
        if value is not None:
            assert isinstance(claimed, oncely.Acquired)
            assert store.complete(key, claimed.token, value.encode(), ttl=ttl) is None
            stored(key, value)

    async def aloop() -> None:
        try:
            while not stop.is_set():
                for key in config["keys"]:
                    await arun(key)
                await asyncio.sleep(0.02)
        finally:
            await store.aclose()

    pipe.send({"ev": "ready", "worker": name, "t": now()})
    try:
        if name == "B":
            asyncio.run(aloop())
        else:
            try:
                while not stop.is_set():
                    for key in config["keys"]:
                        run(key)
                    time.sleep(0.02)
            finally:
                store.close()
        pipe.send({"ev": "exit", "worker": name, "t": now()})
    finally:
        pipe.close()


# -- one history -----------------------------------------------------------------------------


def run_history(plan: Plan, services: Services) -> Result:
    """Three caching workers; forgets (or expiries and purges) between their attempts."""
    from tests.faults._campaign import Result, _Process

    started = now()
    rng = random.Random(plan.seed)
    url = _url(plan, services)
    namespace = f"faults-{services.run}-{plan.index}"
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    ttl = PURGE_TTL if plan.fault == "purge" else 60.0
    history = History(plan.name, ttl=ttl, keys=keys)
    lock = threading.Lock()
    own = oncely.open_store(url, namespace=namespace)
    if plan.store == "sqlite":  # the workers race to create the schema otherwise
        own.migrate()  # type: ignore[attr-defined]
    gap = (PURGE_TTL if plan.fault == "purge" else MAX_STALENESS) + 0.4
    stop = multiprocessing.get_context("forkserver").Event()
    base = {"url": url, "namespace": namespace, "keys": keys, "ttl": ttl, "stop": stop}
    workers = [_Process({**base, "worker": name}, history, lock, worker) for name in WORKERS]
    faults: list[str] = []
    try:
        for each in workers:
            if not each.wait_for(lambda event: event["ev"] in ("stored", "answer")):
                raise RuntimeError(f"the workers of {plan.name} did not start")
        for round_ in range(ROUNDS):
            time.sleep(gap * rng.uniform(0.6, 1.0))  # the workers cache and replay meanwhile
            if plan.fault == "purge":
                _event(history, lock, "purge", "", now())
                own.purge()  # type: ignore[attr-defined]
            forgotten = keys if plan.fault == "forget" else keys[: rng.randint(0, len(keys))]
            for key in forgotten:
                _forget(history, lock, own, url, namespace, key, cli=round_ == 0 and key == keys[0])
                if plan.fault == "forget":  # run again at once, by a process with no cache
                    _rerun(history, lock, own, key, f"R{round_}", ttl)
            faults.append(plan.fault)
        time.sleep(MAX_STALENESS + 2 * SLACK)  # claims past the bound of the last change
        stop.set()
        for each in workers:
            each.join(30)
        exited = {event["worker"] for event in history.of("exit")}
        if exited != set(WORKERS):  # a worker that failed proves nothing: not a pass
            raise RuntimeError(f"workers {set(WORKERS) - exited} of {plan.name} failed")
    finally:
        stop.set()
        for each in workers:
            each.kill()
        own.close()
    with lock:
        events = sorted(history.events, key=lambda event: event["t"])
    history.events = events
    return Result(plan, history, check(history, ttl=ttl), faults, now() - started)


def _event(history: History, lock: threading.Lock, ev: str, key: str, t: float) -> None:
    with lock:
        history.add({"ev": ev, "worker": "campaign", "key": key, "t": t, "done": now()})


def _forget(
    history: History,
    lock: threading.Lock,
    store: Any,
    url: str,
    namespace: str,
    key: str,
    *,
    cli: bool,
) -> None:
    """Forget *key* through *store* or ``oncely forget``. A record found in progress is left
    (a worker runs the key again: its earlier result is gone already)."""
    started = now()
    if cli:
        command = [sys.executable, "-m", "oncely.cli", "--store", url, "--namespace", namespace]
        done = subprocess.run(
            [*command, "forget", key], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode in (0, 1), done.stderr  # 1: no live record, or in progress
    else:
        with contextlib.suppress(oncely.ConflictError):
            store.forget(key)
    _event(history, lock, "forget", key, started)


def _rerun(
    history: History, lock: threading.Lock, store: Any, key: str, value: str, ttl: float
) -> None:
    lease = timedelta(seconds=30)
    sent = now()
    claimed = store.claim(key, "fp", lease=lease, ttl=timedelta(seconds=ttl))
    if isinstance(claimed, oncely.Acquired):
        with lock:
            history.add({"ev": "run", "worker": "campaign", "key": key, "value": value, "t": sent})
        assert (
            store.complete(key, claimed.token, value.encode(), ttl=timedelta(seconds=ttl)) is None
        )
        with lock:
            history.add(
                {"ev": "stored", "worker": "campaign", "key": key, "value": value, "t": now()}
            )


# -- the check -------------------------------------------------------------------------------


def check(history: History, *, ttl: float) -> list[Anomaly]:
    """Every answer given from a claim sent past its result's end plus the bound."""
    bound = MAX_STALENESS + SLACK
    forgets: dict[str, list[tuple[float, float]]] = {}
    for event in history.of("forget"):
        forgets.setdefault(event["key"], []).append((event["t"], event["done"]))
    stored = {(event["key"], event["value"]): event["t"] for event in history.of("stored")}
    anomalies: list[Anomaly] = []
    newest: dict[tuple[str, str], tuple[float, str]] = {}  # (key, worker): last answer seen
    for event in sorted(history.of("run") + history.of("answer"), key=lambda e: e["t"]):
        key, value, sent = event["key"], event["value"], event["t"]
        at = stored.get((key, value))
        newest[(key, event["worker"])] = (sent, value)
        if event["ev"] == "run" or at is None:
            continue
        ends = [done for start, done in forgets.get(key, []) if start > at] + [at + ttl]
        end = min(ends)
        if sent <= end + bound:
            continue
        others = [
            (worker, seen)
            for (seen_key, worker), (_, seen) in newest.items()
            if seen_key == key and worker != event["worker"] and stored.get((key, seen), 0) > end
        ]
        kind = "split_answer" if others else "stale_replay"
        what = "forgotten" if end < at + ttl else "expired"
        told = f"; {others[0][0]} already answered {others[0][1]}" if others else ""
        anomalies.append(
            Anomaly(
                kind,
                key,
                f"{event['worker']} replayed {value} {sent - end:.2f} s after it was {what} "
                f"(bound {MAX_STALENESS} s){told}",
            )
        )
    return anomalies
