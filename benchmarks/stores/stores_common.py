"""What the store benchmark's parts share: its settings, the timing of one run, the
collected samples and the verdicts (`bench_stores.py` runs it)."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stores.md"

LEASE = datetime.timedelta(seconds=30)
TTL = datetime.timedelta(seconds=300)
LEASE_MS = 30_000
TTL_S = 300
FINGERPRINT = hashlib.sha256(b"oncely store benchmark").hexdigest()
RESULT = b'{"payment_id":"pay_0123456789","status":"captured","amount_cents":1250,"currency":"EUR"}'
CONCURRENCY = 32
TARGET_RATIO = 0.85
TARGET_TIERED = 20.0
TIERED_REPEAT = 20
"""A tiered replay takes microseconds: each timed run goes over its keys this many times."""

MODES = ("sync x1", f"sync x{CONCURRENCY}", "async x1", f"async x{CONCURRENCY}")
OPS = ("cycle", "replay")
OP_LABELS = {
    "cycle": "new-key cycle (claim + complete)",
    "replay": "replay (claim of a completed key)",
}


class BenchError(Exception):
    """A subject answered something other than what the measured path expects."""


# -- measuring ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One timed run: throughput and per-operation latency."""

    ops_per_s: float
    p50_us: float
    p99_us: float


def _summarize(latencies_ns: list[int], elapsed_s: float) -> Sample:
    latencies_ns.sort()
    last = len(latencies_ns) - 1
    return Sample(
        ops_per_s=len(latencies_ns) / elapsed_s,
        p50_us=latencies_ns[round(0.50 * last)] / 1000,
        p99_us=latencies_ns[round(0.99 * last)] / 1000,
    )


def _slices(keys: Sequence[str], concurrency: int) -> list[Sequence[str]]:
    return [keys[index::concurrency] for index in range(concurrency)]


def run_sync(op: Callable[[str], None], keys: Sequence[str], concurrency: int) -> Sample:
    """Run *op* once per key, on *concurrency* threads (1: the calling thread)."""
    clock = time.perf_counter_ns
    if concurrency == 1:
        latencies: list[int] = []
        started = time.perf_counter()
        for key in keys:
            before = clock()
            op(key)
            latencies.append(clock() - before)
        return _summarize(latencies, time.perf_counter() - started)

    barrier = threading.Barrier(concurrency + 1)
    per_thread: list[list[int]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []

    def work(mine: Sequence[str], latencies: list[int]) -> None:
        barrier.wait()
        try:
            for key in mine:
                before = clock()
                op(key)
                latencies.append(clock() - before)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(mine, latencies), daemon=True)
        for mine, latencies in zip(_slices(keys, concurrency), per_thread, strict=True)
    ]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return _summarize([value for latencies in per_thread for value in latencies], elapsed)


async def run_async(
    op: Callable[[str], Awaitable[None]], keys: Sequence[str], concurrency: int
) -> Sample:
    """Await *op* once per key, in *concurrency* asyncio tasks."""
    clock = time.perf_counter_ns

    async def work(mine: Sequence[str], latencies: list[int]) -> None:
        for key in mine:
            before = clock()
            await op(key)
            latencies.append(clock() - before)

    per_task: list[list[int]] = [[] for _ in range(concurrency)]
    started = time.perf_counter()
    await asyncio.gather(
        *(
            work(mine, latencies)
            for mine, latencies in zip(_slices(keys, concurrency), per_task, strict=True)
        )
    )
    elapsed = time.perf_counter() - started
    return _summarize([value for latencies in per_task for value in latencies], elapsed)


# -- collecting --------------------------------------------------------------------------------


@dataclass
class Results:
    """Every sample, by (store, mode, operation, subject), in round order."""

    samples: dict[tuple[str, str, str, str], list[Sample]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)

    def add(self, store: str, mode: str, op: str, subject: str, sample: Sample) -> None:
        self.samples.setdefault((store, mode, op, subject), []).append(sample)

    def get(self, store: str, mode: str, op: str, subject: str) -> list[Sample]:
        return self.samples.get((store, mode, op, subject), [])


def median_of(samples: list[Sample], name: str) -> float:
    return statistics.median(float(getattr(sample, name)) for sample in samples)


def ratios(numerator: list[Sample], denominator: list[Sample]) -> list[float]:
    """Per-round throughput ratios (subjects of one round ran next to each other)."""
    return [
        top.ops_per_s / bottom.ops_per_s
        for top, bottom in zip(numerator, denominator, strict=False)
    ]


class Subject(Protocol):
    """Something measured: a cycle on a new key and a replay of a completed key, both worlds."""

    name: str

    def key(self, serial: str) -> str:
        """The key this subject uses for the operation numbered *serial*."""
        ...

    def cycle(self, key: str) -> None: ...

    def replay(self, key: str) -> None: ...

    async def acycle(self, key: str) -> None: ...

    async def areplay(self, key: str) -> None: ...


class Keys:
    """Fresh keys: no two operations of a run ever share one."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.serials = itertools.count()

    def fresh(self, subject: Subject, count: int) -> list[str]:
        batch = next(self.serials)
        return [subject.key(f"{self.run_id}-{batch}-{index}") for index in range(count)]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- memory://: the decorator's own cost ---------------------------------------------------------

TARGET_MEMORY = {"new": 0.5, "replay": 0.7}
"""The hot-path issue's targets: the decorator on memory:// over the dict reference."""
CALL_BUDGET = {"new": 60, "replay": 40}
"""... and the Python function calls of one decorated call, at most."""
CALLS = ("sync new", "sync replay", "async new", "async replay")


@dataclass
class MemoryFigures:
    """Per tree ("oncely", and "baseline" with ``--baseline``): its rounds' figures."""

    rounds: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    calls: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    stages: list[dict[str, float]] = field(default_factory=list)
    ops: int = 0


# -- Redis server CPU per transition ------------------------------------------------------------

TARGET_SERVER_US = 12.0
"""The hot-path issue's target: µs of Redis server time per transition, at most."""


@dataclass
class ServerCpu:
    """Per tree ("oncely", and "baseline" with ``--baseline``): each round's µs per call, by
    transition and command (`server_cpu.one_round`)."""

    rounds: dict[str, list[dict[str, dict[str, float]]]] = field(default_factory=dict)
    ops: int = 0
    version: str = ""


# -- SQL stores: the @idempotent rows, and SQLite ----------------------------------------------

SQLITE_SYNCHRONOUS = ("full", "normal")
"""The ``synchronous`` settings measured: the store's default (survives power loss), and the
faster one that survives a process crash only. Both in WAL mode, as the store runs."""


FLOORS = ("psycopg floor", "asyncpg floor")
"""The floor subjects of a SQL store (`floors`), x1 only."""
TARGET_FLOOR = {"sync x1": 0.8, "async x1": 0.8}

ASYNCPG_DECORATED = "oncely @idempotent (asyncpg)"
"""The decorated function (async only) on a PostgreSQL store whose async verbs run on asyncpg
(``async_driver="asyncpg"``), beside the asyncpg floor."""
"""The floor issue's targets: `@idempotent` over the fastest floor of its world."""


TARGET_SQLITE_REPLAY = 0.5
"""The hot-path issue's target for a SQLite replay (the others are `TARGET_RATIO`)."""


def sql_target(store: str, op: str) -> float:
    """The target ratio to raw of *op* on *store*."""
    return TARGET_SQLITE_REPLAY if store.startswith("SQLite") and op == "replay" else TARGET_RATIO


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _us(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio_cell(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    middle = statistics.median(values)
    if len(values) < 4:
        return f"{middle:.{digits}f}"
    low, _, high = statistics.quantiles(values, n=4)
    return f"{middle:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "-"
    return "met" if value >= target else "**MISSED**"


@dataclass
class Verdict:
    what: str
    value: float
    target: float
    at_most: bool = False  # the value must not exceed the target
