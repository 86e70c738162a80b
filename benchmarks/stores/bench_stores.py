"""Benchmark oncely's server stores against the raw driver doing the same round trips.

    python benchmarks/stores/bench_stores.py            # the full run (about 4 minutes)
    python benchmarks/stores/bench_stores.py --quick    # about a minute
    python benchmarks/stores/bench_stores.py --ops 5000 --rounds 7 --stores redis

For each server store (Redis, PostgreSQL, and Redis Cluster when it answers), sync and async,
one worker and 32 concurrent workers (threads for sync, asyncio tasks for async), it measures:

- the new-key cycle: ``claim`` then ``complete`` of a key never seen before;
- the replay: ``claim`` of a key that is already completed (the answer carries the result);

and, in the same round, the raw driver doing the same round trips on the same kind of pool:

- Redis: ``SET key value NX PX lease`` then ``SET key result EX ttl``; the replay is ``GET``;
- PostgreSQL: ``INSERT … ON CONFLICT DO NOTHING RETURNING`` then ``UPDATE``; the replay is a
  ``SELECT`` of the row; both on a ``psycopg_pool`` pool of oncely's default sizes (1..10).

On ``memory://`` (no server), it measures the decorator's own cost: ``@idempotent`` beside the
hot-path issue's 25-line dict-based reference decorator (`hotpath.reference`), sync and async,
new key and replay, as ratios to it; the Python function calls of one decorated call; and the
microseconds each stage of a call takes. With ``--baseline DIR`` (a directory holding another
oncely's ``src``, such as ``git archive main src | tar -x -C DIR``), that oncely is measured
in the same run, its rounds interleaved with this one's, for before/after figures.

SQLite (``--stores sqlite``; ``--stores postgres sqlite`` for the SQL stores alone) is measured
the same way against sqlite3 doing the same transactions, in WAL mode, once with
``synchronous=full`` (the store's default) and once with ``normal``; on PostgreSQL and SQLite the
decorated function (``@idempotent``, x1) is measured beside the store verbs.

It also measures the tiered store's replay (``tiered+redis://``, answered from memory) against
the raw ``GET``, and, as a reference at the level of a decorated function (sequential, sync,
Redis), oncely's ``@idempotent`` beside AWS Powertools' ``idempotent_function`` with its
Redis persistence layer (skipped when ``aws-lambda-powertools`` is not installed).

Subjects run interleaved, in rounds whose order rotates, so drift in the load of a shared
machine falls on all of them; each figure is the median over the rounds, and each ratio is the
median of the per-round ratios. The report goes to stdout and to ``benchmarks/results/stores.md``.
Not a test: pytest never collects this directory. Every key, table and schema it creates is
its own (a per-run prefix and schema) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import oncely
from oncely import Acquired, Replay

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


# -- subjects: what is measured ----------------------------------------------------------------


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


class OncelySubject:
    """oncely's store verbs, as an entry point calls them."""

    def __init__(self, name: str, store: Any) -> None:
        self.name = name
        self.store = store

    def key(self, serial: str) -> str:
        return serial  # the store adds its prefix and namespace

    def cycle(self, key: str) -> None:
        claim = self.store.claim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(claim, Acquired):
            raise BenchError(f"{self.name}: claim of a new key answered {claim!r}")
        if self.store.complete(key, claim.token, RESULT, ttl=TTL) is not None:
            raise BenchError(f"{self.name}: complete lost its lease")

    def replay(self, key: str) -> None:
        answer = self.store.claim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(answer, Replay):
            raise BenchError(f"{self.name}: claim of a completed key answered {answer!r}")

    async def acycle(self, key: str) -> None:
        claim = await self.store.aclaim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(claim, Acquired):
            raise BenchError(f"{self.name}: claim of a new key answered {claim!r}")
        if await self.store.acomplete(key, claim.token, RESULT, ttl=TTL) is not None:
            raise BenchError(f"{self.name}: complete lost its lease")

    async def areplay(self, key: str) -> None:
        answer = await self.store.aclaim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
        if not isinstance(answer, Replay):
            raise BenchError(f"{self.name}: claim of a completed key answered {answer!r}")


class RawRedis:
    """redis-py doing the round trips of a Redis store: SET NX PX + SET EX, and GET."""

    name = "raw"

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.aclient: Any = None  # made in the event loop
        self.prefix = prefix
        self.claimed = b"in_progress|" + FINGERPRINT.encode()

    def key(self, serial: str) -> str:
        return self.prefix + serial

    def cycle(self, key: str) -> None:
        if not self.client.set(key, self.claimed, nx=True, px=LEASE_MS):
            raise BenchError(f"raw Redis: SET NX of a new key {key!r} failed")
        self.client.set(key, RESULT, ex=TTL_S)

    def replay(self, key: str) -> None:
        if self.client.get(key) is None:
            raise BenchError(f"raw Redis: GET of a completed key {key!r} found nothing")

    async def acycle(self, key: str) -> None:
        if not await self.aclient.set(key, self.claimed, nx=True, px=LEASE_MS):
            raise BenchError(f"raw Redis: SET NX of a new key {key!r} failed")
        await self.aclient.set(key, RESULT, ex=TTL_S)

    async def areplay(self, key: str) -> None:
        if await self.aclient.get(key) is None:
            raise BenchError(f"raw Redis: GET of a completed key {key!r} found nothing")


RAW_TABLE_SQL = """
CREATE TABLE {schema}.raw_records (
    key              text COLLATE "C" PRIMARY KEY,
    status           text        NOT NULL,
    fingerprint      text        NOT NULL,
    token            bigint      NOT NULL,
    attempt          integer     NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    result           bytea
);
CREATE INDEX raw_records_expires_at ON {schema}.raw_records (expires_at);
"""
"""The same row and indexes as oncely's ``oncely_records``, so each write costs the same."""

RAW_INSERT = """
INSERT INTO {schema}.raw_records AS r
       (key, status, fingerprint, token, attempt, lease_expires_at, expires_at,
        created_at, updated_at)
VALUES (%s, 'in_progress', %s, 1, 1, now() + %s, now() + %s, now(), now())
ON CONFLICT (key) DO NOTHING
RETURNING r.token
"""

RAW_UPDATE = """
UPDATE {schema}.raw_records
   SET status = 'completed', result = %s, expires_at = now() + %s,
       lease_expires_at = now(), updated_at = now()
 WHERE key = %s AND token = %s AND status = 'in_progress'
"""

RAW_SELECT = """
SELECT status, fingerprint, token, attempt, lease_expires_at, expires_at, created_at,
       updated_at, result
  FROM {schema}.raw_records
 WHERE key = %s AND expires_at > now()
"""


class RawPostgres:
    """psycopg on a psycopg_pool pool: INSERT … ON CONFLICT DO NOTHING RETURNING + UPDATE,
    and SELECT; one pool checkout per statement, as oncely's store does."""

    name = "raw"

    def __init__(self, pool: Any, schema: str) -> None:
        self.pool = pool
        self.apool: Any = None  # made in the event loop
        self.insert = RAW_INSERT.format(schema=schema)
        self.update = RAW_UPDATE.format(schema=schema)
        self.select = RAW_SELECT.format(schema=schema)

    def key(self, serial: str) -> str:
        return serial

    def cycle(self, key: str) -> None:
        with self.pool.connection() as connection:
            row = connection.execute(self.insert, (key, FINGERPRINT, LEASE, TTL)).fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: INSERT of a new key {key!r} conflicted")
        with self.pool.connection() as connection:
            done = connection.execute(self.update, (RESULT, TTL, key, row[0]))
        if done.rowcount != 1:
            raise BenchError(f"raw PostgreSQL: UPDATE of {key!r} matched no row")

    def replay(self, key: str) -> None:
        with self.pool.connection() as connection:
            row = connection.execute(self.select, (key,)).fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: SELECT of a completed key {key!r} found nothing")

    async def acycle(self, key: str) -> None:
        async with self.apool.connection() as connection:
            cursor = await connection.execute(self.insert, (key, FINGERPRINT, LEASE, TTL))
            row = await cursor.fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: INSERT of a new key {key!r} conflicted")
        async with self.apool.connection() as connection:
            done = await connection.execute(self.update, (RESULT, TTL, key, row[0]))
        if done.rowcount != 1:
            raise BenchError(f"raw PostgreSQL: UPDATE of {key!r} matched no row")

    async def areplay(self, key: str) -> None:
        async with self.apool.connection() as connection:
            cursor = await connection.execute(self.select, (key,))
            row = await cursor.fetchone()
        if row is None:
            raise BenchError(f"raw PostgreSQL: SELECT of a completed key {key!r} found nothing")


class Decorated:
    """A decorated function (sync, and async with *acall*): its first call per key runs, the
    second replays."""

    def __init__(
        self,
        name: str,
        call: Callable[[str], Any],
        key_prefix: str = "",
        acall: Callable[[str], Awaitable[Any]] | None = None,
    ) -> None:
        self.name = name
        self.call = call
        self.acall = acall
        self.key_prefix = key_prefix
        self.runs = 0

    def key(self, serial: str) -> str:
        return self.key_prefix + serial

    def cycle(self, key: str) -> None:
        self.call(key)

    def replay(self, key: str) -> None:
        self.call(key)

    async def acycle(self, key: str) -> None:
        if self.acall is None:
            raise NotImplementedError
        await self.acall(key)

    async def areplay(self, key: str) -> None:
        await self.acycle(key)


def oncely_decorated(store: Any) -> Decorated:
    """``@oncely.idempotent`` around a payment function, sync and async, default policy."""
    options: dict[str, Any] = {"store": store, "key": "payment_id", "ttl": TTL, "lease": LEASE}

    @oncely.idempotent(**options)
    def charge(payment_id: str, amount_cents: int) -> dict[str, Any]:
        subject.runs += 1
        return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}

    @oncely.idempotent(**options)
    async def acharge(payment_id: str, amount_cents: int) -> dict[str, Any]:
        subject.runs += 1
        return {"payment_id": payment_id, "status": "captured", "amount_cents": amount_cents}

    subject = Decorated(
        "oncely @idempotent",
        lambda key: charge(key, 1250),
        acall=lambda key: acharge(key, 1250),
    )
    return subject


class _LambdaContext:
    """Just enough of a Lambda context for Powertools to set an in-progress expiry (a lease)."""

    function_name = "bench"
    aws_request_id = "bench"

    def get_remaining_time_in_millis(self) -> int:
        return LEASE_MS


def powertools_decorated(url: str, key_prefix: str) -> Decorated | str:
    """Powertools' ``idempotent_function`` on its Redis persistence layer, or why not."""
    try:
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
            CachePersistenceLayer,
        )
    except ImportError as exc:
        return (
            f"aws-lambda-powertools is not usable ({exc}): "
            "pip install 'aws-lambda-powertools[redis,aws-sdk]'"
        )
    import redis

    client: Any = redis.Redis.from_url(url, decode_responses=True)
    layer = CachePersistenceLayer(client=client)
    config = IdempotencyConfig(
        event_key_jmespath="payment_id",
        # No payload_validation_jmespath: the Redis layer's _update_record drops the payload hash,
        # so with it every replay raises IdempotencyValidationError (aws-lambda-powertools 3.37).
        expires_after_seconds=TTL_S,
    )
    config.register_lambda_context(_LambdaContext())  # type: ignore[arg-type]

    decorate: Any = idempotent_function(
        data_keyword_argument="payment",
        persistence_store=layer,
        config=config,
        key_prefix=key_prefix,
    )

    def _charge(payment: dict[str, Any]) -> dict[str, Any]:
        subject.runs += 1
        return {"payment_id": payment["payment_id"], "status": "captured", "amount_cents": 1250}

    charge = decorate(_charge)

    subject = Decorated(
        "Powertools idempotent_function",
        lambda key: charge(payment={"payment_id": key, "amount_cents": 1250}),
    )
    return subject


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


# -- one store ---------------------------------------------------------------------------------


@dataclass
class Plan:
    """What one store's benchmark runs."""

    store: str  # the label in the report
    raw: Subject
    oncely: Subject
    tiered: Subject | None = None
    decorated: list[Decorated] = field(default_factory=list)
    floors: list[Any] = field(default_factory=list)  # x1 only (`floors`), in their worlds
    open_async: Callable[[], Awaitable[None]] | None = None  # make the raw async client
    close_async: Callable[[], Awaitable[None]] | None = None  # close every async client
    note: str = ""  # why a reference column is missing


def _rotated(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def _sync_pair(subject: Subject, batch: list[str], concurrency: int) -> tuple[Sample, Sample]:
    """Cycle then replay *batch*; for a decorated function, check each key ran exactly once."""
    runs = subject.runs if isinstance(subject, Decorated) else 0
    cycle = run_sync(subject.cycle, batch, concurrency)
    replay = run_sync(subject.replay, batch, concurrency)
    _check_runs(subject, runs, batch)
    return cycle, replay


def _check_runs(subject: Subject, runs: int, batch: list[str]) -> None:
    if isinstance(subject, Decorated) and subject.runs - runs != len(batch):
        raise BenchError(
            f"{subject.name}: {subject.runs - runs} executions for {len(batch)} new keys, "
            "each called twice"
        )


def bench_sync(plan: Plan, results: Results, keys: Keys, ops: int, rounds: int) -> None:
    for mode, concurrency in ((MODES[0], 1), (MODES[1], CONCURRENCY)):
        subjects: list[Subject] = [plan.raw, plan.oncely]
        if concurrency == 1:
            subjects += [each for each in plan.floors if "sync" in each.worlds]
            subjects += plan.decorated
        warm = max(CONCURRENCY * 4, ops)
        for round_number in range(-1, rounds):  # round -1 is the warm-up
            for subject in _rotated(list(subjects), max(round_number, 0)):
                batch = keys.fresh(subject, warm if round_number < 0 else ops)
                try:
                    cycle, replay = _sync_pair(subject, batch, concurrency)
                except Exception as exc:
                    if not isinstance(subject, Decorated):
                        raise
                    # A reference column failing does not void the store's figures.
                    subjects.remove(subject)
                    for op in OPS:
                        results.samples.pop((plan.store, mode, op, subject.name), None)
                    results.notes.setdefault(plan.store, []).append(
                        f"{subject.name} failed, so it has no figures: {type(exc).__name__}: {exc}"
                    )
                    _log(f"  {subject.name} FAILED: {exc!r}")
                    continue
                if round_number >= 0:
                    results.add(plan.store, mode, "cycle", subject.name, cycle)
                    results.add(plan.store, mode, "replay", subject.name, replay)
                if subject is plan.oncely and plan.tiered is not None:
                    run_sync(plan.tiered.replay, batch, concurrency)  # fills the cache
                    sample = run_sync(plan.tiered.replay, batch * TIERED_REPEAT, concurrency)
                    if round_number >= 0:
                        results.add(plan.store, mode, "replay", plan.tiered.name, sample)
        _log(f"  {plan.store} {mode}: {rounds} rounds done")


async def bench_async(plan: Plan, results: Results, keys: Keys, ops: int, rounds: int) -> None:
    assert plan.open_async is not None
    assert plan.close_async is not None
    try:
        await plan.open_async()
        for mode, concurrency in ((MODES[2], 1), (MODES[3], CONCURRENCY)):
            subjects: list[Subject] = [plan.raw, plan.oncely]
            if concurrency == 1:
                subjects += [each for each in plan.floors if "async" in each.worlds]
                subjects += [each for each in plan.decorated if each.acall is not None]
            warm = max(CONCURRENCY * 4, ops)
            for round_number in range(-1, rounds):  # round -1 is the warm-up
                for subject in _rotated(subjects, max(round_number, 0)):
                    batch = keys.fresh(subject, warm if round_number < 0 else ops)
                    runs = subject.runs if isinstance(subject, Decorated) else 0
                    cycle = await run_async(subject.acycle, batch, concurrency)
                    replay = await run_async(subject.areplay, batch, concurrency)
                    _check_runs(subject, runs, batch)
                    if round_number >= 0:
                        results.add(plan.store, mode, "cycle", subject.name, cycle)
                        results.add(plan.store, mode, "replay", subject.name, replay)
                    if subject is plan.oncely and plan.tiered is not None:
                        await run_async(plan.tiered.areplay, batch, concurrency)  # fills the cache
                        sample = await run_async(
                            plan.tiered.areplay, batch * TIERED_REPEAT, concurrency
                        )
                        if round_number >= 0:
                            results.add(plan.store, mode, "replay", plan.tiered.name, sample)
            _log(f"  {plan.store} {mode}: {rounds} rounds done")
    finally:
        await plan.close_async()


def bench_plan(plan: Plan, results: Results, keys: Keys, ops: int, rounds: int) -> None:
    started = time.perf_counter()
    bench_sync(plan, results, keys, ops, rounds)
    asyncio.run(bench_async(plan, results, keys, ops, rounds))
    _log(f"  {plan.store}: {time.perf_counter() - started:.0f} s")


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


def _memory_round(src: Path, ops: int, turn: int, *options: str) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "hotpath.py"), "--ops", str(ops), "--turn", str(turn)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT)])}
    done = subprocess.run(
        [*command, *options],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise BenchError(f"hotpath.py with {src} failed:\n{done.stderr}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def bench_memory(rounds: int, ops: int, baseline: Path | None) -> MemoryFigures:
    """The decorator and the dict reference on memory://, one child process per tree and round
    (trees alternate), so a baseline oncely is measured in the same run."""
    trees = {"oncely": ROOT / "src"}
    if baseline is not None:
        trees["baseline"] = baseline / "src" if (baseline / "src").is_dir() else baseline
    figures = MemoryFigures(ops=ops)
    _log(f"memory://: {rounds} rounds of {ops} calls per subject, trees: {', '.join(trees)}")
    for number in range(rounds):
        for name in _rotated(list(trees), number):
            found = _memory_round(
                trees[name], ops, number, "--calls", *(["--stages"] if name == "oncely" else [])
            )
            figures.rounds.setdefault(name, []).append(found["round"])
            figures.calls[name] = found["calls"]
            if name == "oncely":
                figures.stages.append(found["stages"])
    _log("  memory://: done")
    return figures


def _tree_label(tree: str) -> str:
    return "oncely (this tree)" if tree == "oncely" else "oncely (baseline)"


def memory_sections(memory: MemoryFigures, verdicts: list[Verdict]) -> list[str]:
    lines = [
        "## Decorator on memory://",
        "",
        "The payment function decorated by `@idempotent` on `memory://` (default policy) and by "
        "the dict-based reference decorator of the hot-path issue (it binds the signature, "
        "fingerprints the arguments with JSON and SHA-256, keeps records in a dict under a "
        "lock: `benchmarks/stores/hotpath.py`), one worker; a new key is a first call, a "
        f"replay a second call of the same key. {len(memory.rounds['oncely'])} rounds of "
        f"{memory.ops:,} calls per subject, each round in a process of its own"
        + (
            ", the rounds of the two oncely trees alternating"
            if "baseline" in memory.rounds
            else ""
        )
        + ". µs per call are medians over the rounds; the ratio is reference µs / oncely µs "
        "per round (median, interquartile range in brackets).",
        "",
        "| subject | call | reference µs | oncely µs | oncely/reference (IQR) | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for tree, rounds in memory.rounds.items():
        for what in CALLS:
            mine = [each[f"oncely {what}"] for each in rounds]
            ref = [each[f"reference {what}"] for each in rounds]
            per_round = [r / m for r, m in zip(ref, mine, strict=True)]
            target = TARGET_MEMORY[what.split()[1]]
            value = statistics.median(per_round)
            if tree == "oncely":
                verdicts.append(Verdict(f"memory://, {what}: oncely/reference", value, target))
            lines.append(
                f"| {_tree_label(tree)} | {what} | {statistics.median(ref):.1f} "
                f"| {statistics.median(mine):.1f} | {_ratio_cell(per_round, 3)} "
                f"| ≥ {target:g}: {_verdict(value, target)} |"
            )
    lines += [
        "",
        "## Python calls per decorated call",
        "",
        "Counted with `sys.setprofile` over one call of the decorated function on `memory://` "
        "(its own call included; a generator resumed counts as a call), after warm-up. "
        "`tests/decorator/test_call_budget.py` pins the counts of this tree.",
        "",
        "| subject | call | Python calls | C calls | budget |",
        "|---|---|---:|---:|---|",
    ]
    for tree, calls in memory.calls.items():
        for what in CALLS:
            python, c = calls[what]
            budget = CALL_BUDGET[what.split()[1]]
            lines.append(
                f"| {_tree_label(tree)} | {what} | {python} | {c} "
                f"| ≤ {budget}: {'met' if python <= budget else '**MISSED**'} |"
            )
    lines += ["", *stage_table(memory.stages), ""]
    return lines


def stage_table(samples: list[dict[str, float]]) -> list[str]:
    from hotpath import STAGES

    lines = [
        "## µs per stage per call",
        "",
        "The steps of the straight line a decorated call runs on `memory://`, taken one by one "
        "with a clock read between them (`hotpath.stages`: the medians over the calls of a "
        "round, then over the rounds). The total is that of the steps so timed; the whole "
        "decorated call, timed apart, is in the table above (the difference is the wrapper "
        "itself: the switches, the closure that calls the function).",
        "",
        "| stage | what | sync new | async new | sync replay | async replay |",
        "|---|---|---:|---:|---:|---:|",
    ]
    named = dict(STAGES["new"] + STAGES["replay"])

    def cell(key: str) -> str:
        values = [each[key] for each in samples if key in each]
        return f"{statistics.median(values):.2f}" if values else ""

    for stage, what in named.items():
        lines.append(
            f"| {stage} | {what} | {cell(f'sync new {stage}')} | {cell(f'async new {stage}')} "
            f"| {cell(f'sync replay {stage}')} | {cell(f'async replay {stage}')} |"
        )
    lines.append(
        f"| total | | {cell('sync new total')} | {cell('async new total')} "
        f"| {cell('sync replay total')} | {cell('async replay total')} |"
    )
    return lines


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


def bench_server_cpu(rounds: int, ops: int, baseline: Path | None, port: int) -> ServerCpu:
    """`server_cpu.one_round` on a private redis-server of this run's, one child process per
    tree and round (trees alternate), so a baseline's scripts are measured in the same run."""
    from server_cpu import private_server

    trees = {"oncely": ROOT / "src"}
    if baseline is not None:
        trees["baseline"] = baseline / "src" if (baseline / "src").is_dir() else baseline
    figures = ServerCpu(ops=ops)
    _log(f"Redis server CPU: {rounds} rounds of {ops} calls per transition on port {port}")
    with private_server(port) as url:
        import redis

        with redis.Redis.from_url(url) as client:
            figures.version = str(client.info("server")["redis_version"])
        for number in range(rounds):
            for name in _rotated(list(trees), number):
                command = [sys.executable, str(HERE / "server_cpu.py"), "--url", url]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(trees[name]), str(ROOT)])}
                done = subprocess.run(
                    [*command, "--ops", str(ops)], env=env, capture_output=True, text=True
                )
                if done.returncode:
                    raise BenchError(f"server_cpu.py with {trees[name]} failed:\n{done.stderr}")
                figures.rounds.setdefault(name, []).append(json.loads(done.stdout))
    _log("  Redis server CPU: done")
    return figures


def server_cpu_section(cpu: ServerCpu, verdicts: list[Verdict]) -> list[str]:
    from server_cpu import MAIN_THREAD, TRANSITIONS

    lines = [
        "## Redis server CPU per transition",
        "",
        f"`usec_per_call` in `INFO commandstats` of a private `redis-server` {cpu.version} "
        "started for the run (no other client), after `CONFIG RESETSTAT`: each round makes "
        f"{cpu.ops:,} claims of new keys, their completes, then {cpu.ops:,} claims of the "
        "completed keys (replays), and the raw yardsticks: redis-py's `SET … NX PX` of new keys "
        "and `GET`s of them (`benchmarks/stores/server_cpu.py`, one process per tree and round"
        + (", the two oncely trees alternating" if "baseline" in cpu.rounds else "")
        + f"). Medians over {len(cpu.rounds.get('oncely', []))} rounds, with the lowest and "
        "highest round in brackets. A function's (or script's) time includes the commands it runs "
        "inside, "
        "which the last column lists (each counted apart by Redis as well). `commandstats` "
        "times are wall-clock time in the server's main thread: on a loaded machine they "
        "include time the server was scheduled out, so compare rows of one run, never runs. "
        "The main thread's CPU time per call (`INFO cpu`, user + system) is not inflated by "
        "scheduling, but counts all of a command's work: reading the request, running it, "
        "writing the reply.",
        "",
        "| subject | transition | command | server µs per call | commands inside, µs each "
        f"| main thread CPU µs per call | target ≤ {TARGET_SERVER_US:g} µs |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for tree, rounds in cpu.rounds.items():
        for transition in TRANSITIONS:
            found = [each[transition] for each in rounds if transition in each]
            if not found:
                continue
            calls = [command for command in ("FCALL", "EVALSHA") if command in found[0]]
            main = calls[0] if calls else next(iter(found[0]))
            values = [each.get(main, 0.0) for each in found]
            value = statistics.median(values)
            apart = (main, MAIN_THREAD)
            inside = sorted({command for each in found for command in each if command not in apart})
            thread = [each[MAIN_THREAD] for each in found if MAIN_THREAD in each]
            thread_cell = f"{statistics.median(thread):.1f}" if thread else "-"
            inner = ", ".join(
                f"`{command}` {statistics.median(each.get(command, 0.0) for each in found):.1f}"
                for command in inside
            )
            target = ""
            if not transition.startswith("raw"):
                target = f"{'met' if value <= TARGET_SERVER_US else '**MISSED**'}"
                if tree == "oncely":
                    verdicts.append(
                        Verdict(
                            f"Redis server CPU, {transition}: µs per call",
                            value,
                            TARGET_SERVER_US,
                            at_most=True,
                        )
                    )
            lines.append(
                f"| {_tree_label(tree)} | {transition} | `{main}` | {value:.1f} "
                f"({min(values):.1f}-{max(values):.1f}) | {inner} | {thread_cell} | {target} |"
            )
    return [*lines, ""]


# -- the servers -------------------------------------------------------------------------------


@dataclass
class Servers:
    redis_url: str
    postgres_url: str
    cluster_url: str
    versions: dict[str, str] = field(default_factory=dict)


def _cluster_nodes(url: str) -> list[tuple[str, int]]:
    hosts = url.partition("://")[2].partition("/")[0].partition("?")[0]
    nodes = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        nodes.append((host, int(port)))
    return nodes


def _cluster_client(url: str, module: str, **options: Any) -> Any:
    """A redis-py cluster client (*module*: ``redis.cluster`` or ``redis.asyncio.cluster``)."""
    cluster: Any = importlib.import_module(module)
    nodes = [cluster.ClusterNode(host, port) for host, port in _cluster_nodes(url)]
    return cluster.RedisCluster(startup_nodes=nodes, **options)


def _delete_matching(client: Any, pattern: str) -> int:
    names = list(client.scan_iter(match=pattern, count=1000))
    for start in range(0, len(names), 500):
        client.delete(*names[start : start + 500])
    return len(names)


@contextlib.contextmanager
def redis_plan(servers: Servers, run_id: str, ops: int, cluster: bool) -> Iterator[Plan]:
    """The Redis (or Redis Cluster) store, raw redis-py, and on Redis the tiered store and the
    decorated functions."""
    import redis
    import redis.asyncio

    prefix = f"oncely-bench-{run_id}:"
    options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}  # as oncely's
    if cluster:
        url = servers.cluster_url
        client: Any = _cluster_client(url, "redis.cluster", **options)
        label = "Redis Cluster"
    else:
        url = servers.redis_url
        client = redis.Redis.from_url(url, **options)
        label = "Redis"
    raw = RawRedis(client, f"oncely-bench-{run_id}-raw:")
    store = oncely.open_store(url, namespace="bench", prefix=prefix)
    plan = Plan(label, raw, OncelySubject("oncely", store))
    tiered: Any = None
    async_stores: list[Any] = [store]
    if not cluster:
        tiered = oncely.open_store(
            f"tiered+{url}", namespace="bench", prefix=prefix, max_entries=max(10_000, ops)
        )
        plan.tiered = OncelySubject("oncely tiered", tiered)
        async_stores.append(tiered)
        plan.decorated.append(oncely_decorated(store))
        powertools = powertools_decorated(url, f"oncely-bench-{run_id}-pt")
        if isinstance(powertools, str):
            plan.note = powertools
            _log(f"  Powertools column skipped: {powertools}")
        else:
            plan.decorated.append(powertools)

    async def open_async() -> None:
        if cluster:
            raw.aclient = _cluster_client(url, "redis.asyncio.cluster", **options)
            await raw.aclient.initialize()
        else:
            raw.aclient = redis.asyncio.Redis.from_url(url, **options)

    async def close_async() -> None:
        if raw.aclient is not None:
            await raw.aclient.aclose()
        for each in async_stores:
            await each.aclose()  # the async clients; the sync ones too

    plan.open_async, plan.close_async = open_async, close_async
    try:
        yield plan
    finally:
        with contextlib.suppress(Exception):
            store.close()
            if tiered is not None:
                tiered.close()
        try:
            _delete_matching(client, f"oncely-bench-{run_id}*")
        finally:
            client.close()


@contextlib.contextmanager
def postgres_plan(servers: Servers, run_id: str) -> Iterator[Plan]:
    """The PostgreSQL store in a schema of this run's, raw psycopg on the same pool kind, and
    the floors: psycopg and asyncpg on plain connections with prepared statements."""
    import psycopg
    import psycopg_pool
    from floors import AsyncpgFloor, PsycopgFloor, asyncpg_missing

    schema = f"oncely_bench_{run_id}"
    store: Any = oncely.open_store(servers.postgres_url, namespace="bench", schema=schema)
    sizes: dict[str, Any] = {"min_size": 1, "max_size": 10}  # oncely's defaults
    pool: Any = None
    floors: list[Any] = []
    try:
        store.migrate()
        with psycopg.connect(servers.postgres_url, autocommit=True) as connection:
            connection.execute(RAW_TABLE_SQL.format(schema=schema))
        pool = psycopg_pool.ConnectionPool(
            servers.postgres_url, kwargs={"autocommit": True}, open=True, **sizes
        )
        raw = RawPostgres(pool, schema)
        plan = Plan("PostgreSQL", raw, OncelySubject("oncely", store), floors=floors)
        queries = (raw.insert, raw.update, raw.select)
        floor_args = (servers.postgres_url, queries, FINGERPRINT, RESULT, LEASE, TTL)
        plan.floors.append(PsycopgFloor(*floor_args))
        missing = asyncpg_missing()
        if missing:
            plan.note = missing
            _log(f"  asyncpg floor skipped: {missing}")
        else:
            plan.floors.append(AsyncpgFloor(*floor_args))
        plan.decorated.append(oncely_decorated(store))

        async def open_async() -> None:
            raw.apool = psycopg_pool.AsyncConnectionPool(
                servers.postgres_url, kwargs={"autocommit": True}, open=False, **sizes
            )
            await raw.apool.open()
            for floor in plan.floors:
                await floor.open_async()

        async def close_async() -> None:
            if raw.apool is not None:
                await raw.apool.close()
            for floor in plan.floors:
                await floor.close_async()
            await store.aclose()

        plan.open_async, plan.close_async = open_async, close_async
        yield plan
    finally:
        with contextlib.suppress(Exception):
            store.close()
        if pool is not None:
            pool.close()
        for floor in floors:
            floor.close()
        with psycopg.connect(servers.postgres_url, autocommit=True) as connection:
            connection.execute("SET client_min_messages = warning")
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- SQL stores: the @idempotent rows, and SQLite ----------------------------------------------

SQLITE_SYNCHRONOUS = ("full", "normal")
"""The ``synchronous`` settings measured: the store's default (survives power loss), and the
faster one that survives a process crash only. Both in WAL mode, as the store runs."""


def raw_sqlite_table() -> str:
    """oncely's ``oncely_records`` table and index in SQLite, renamed ``raw_records``: the same
    row and indexes, so each write costs the same."""
    from oncely.stores.sqlite import SQLiteStore

    script = SQLiteStore.schema_sql().split(";")
    return ";".join(each for each in script if "oncely_records" in each).replace(
        "oncely_records", "raw_records"
    )


RAW_SQLITE_INSERT = """
INSERT INTO raw_records (key, status, fingerprint, token, attempt, lease_expires_at_ms,
                         expires_at_ms, created_at_ms, updated_at_ms)
VALUES (?, 'in_progress', ?, 1, 1, ?, ?, ?, ?)
ON CONFLICT (key) DO NOTHING
RETURNING token
"""

RAW_SQLITE_UPDATE = """
UPDATE raw_records
   SET status = 'completed', result = ?, expires_at_ms = ?, lease_expires_at_ms = ?,
       updated_at_ms = ?
 WHERE key = ? AND token = ? AND status = 'in_progress'
"""

RAW_SQLITE_SELECT = """
SELECT status, fingerprint, token, attempt, lease_expires_at_ms, expires_at_ms, created_at_ms,
       updated_at_ms, result
  FROM raw_records WHERE key = ? AND expires_at_ms > ?
"""


class RawSQLite:
    """sqlite3 doing the transactions of a claim, a complete and a replay: each one statement
    in autocommit mode (its own transaction), writers of this process queued on a lock (as
    oncely's store queues them, rather than in SQLite's sleeping busy handler), a connection
    per thread, WAL mode and the store's ``synchronous``. Async calls run the same code inline
    on the event loop: the floor, with no hop to a thread."""

    name = "raw"

    def __init__(self, path: str, synchronous: str) -> None:
        self.path = path
        self.synchronous = synchronous
        self.local = threading.local()
        self.write = threading.Lock()
        self.connections: list[Any] = []

    def connection(self) -> Any:
        connection = getattr(self.local, "connection", None)
        if connection is None:
            import sqlite3

            connection = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={self.synchronous}")
            connection.executescript(raw_sqlite_table())
            self.local.connection = connection
            self.connections.append(connection)
        return connection

    def key(self, serial: str) -> str:
        return serial

    def cycle(self, key: str) -> None:
        connection = self.connection()
        now = int(time.time() * 1000)
        with self.write:
            row = connection.execute(
                RAW_SQLITE_INSERT, (key, FINGERPRINT, now + LEASE_MS, now + TTL_S * 1000, now, now)
            ).fetchone()
        if row is None:
            raise BenchError(f"raw SQLite: INSERT of a new key {key!r} conflicted")
        now = int(time.time() * 1000)
        with self.write:
            done = connection.execute(
                RAW_SQLITE_UPDATE, (RESULT, now + TTL_S * 1000, now, now, key, row[0])
            )
        if done.rowcount != 1:
            raise BenchError(f"raw SQLite: UPDATE of {key!r} matched no row")

    def replay(self, key: str) -> None:
        now = int(time.time() * 1000)
        if self.connection().execute(RAW_SQLITE_SELECT, (key, now)).fetchone() is None:
            raise BenchError(f"raw SQLite: SELECT of a completed key {key!r} found nothing")

    async def acycle(self, key: str) -> None:
        self.cycle(key)

    async def areplay(self, key: str) -> None:
        self.replay(key)

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


@contextlib.contextmanager
def sqlite_plan(run_id: str, synchronous: str) -> Iterator[Plan]:
    """The SQLite store and raw sqlite3 on two files of one temporary folder, with the
    decorated functions; everything is deleted at the end."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"oncely-bench-{run_id}-")
    store: Any = oncely.open_store(
        f"sqlite:///{folder}/oncely.db?synchronous={synchronous}", namespace="bench"
    )
    raw = RawSQLite(f"{folder}/raw.db", synchronous)
    plan = Plan(f"SQLite ({synchronous})", raw, OncelySubject("oncely", store))
    plan.decorated.append(oncely_decorated(store))

    async def nothing() -> None:
        pass

    async def close_async() -> None:
        await store.aclose()

    plan.open_async, plan.close_async = nothing, close_async
    try:
        yield plan
    finally:
        store.close()
        raw.close()
        shutil.rmtree(folder, ignore_errors=True)


def sql_method_note(stores: Sequence[str]) -> list[str]:
    """How the SQLite rows and the SQL stores' `@idempotent` rows are measured."""
    lines = []
    if any(store == "PostgreSQL" or store.startswith("SQLite") for store in stores):
        lines.append(
            "The `@idempotent` rows of PostgreSQL and SQLite are the payment function decorated "
            "with the default policy (x1, sync, and async with an async function), in the same "
            "rounds as the store verbs and the raw driver."
        )
    if any(store.startswith("SQLite") for store in stores):
        lines.append(
            "Raw SQLite is sqlite3 doing the same transactions as the store: `INSERT … ON "
            "CONFLICT DO NOTHING RETURNING` then `UPDATE` (cycle) and `SELECT` (replay), each in "
            "autocommit mode (a transaction of its own), on a table made from oncely's schema, "
            "in WAL mode with the same `synchronous` setting, a connection per thread and this "
            "process's writers queued on a lock, as the store queues them; its async rows run "
            "the same calls inline on the event loop (the floor: no hop to a thread). The files "
            "are in a temporary folder of the run."
        )
    return [*lines, ""] if lines else []


FLOORS = ("psycopg floor", "asyncpg floor")
"""The floor subjects of a SQL store (`floors`), x1 only."""
TARGET_FLOOR = {"sync x1": 0.8, "async x1": 0.8}
"""The floor issue's targets: `@idempotent` over the fastest floor of its world."""


def fastest_floor(results: Results, store: str, mode: str, op: str) -> str | None:
    """The floor of *mode* with the highest median throughput for *op* (``None``: no floor)."""
    found = [
        (median_of(samples, "ops_per_s"), floor)
        for floor in FLOORS
        if (samples := results.get(store, mode, op, floor))
    ]
    return max(found)[1] if found else None


def sql_decorator_section(results: Results, store: str) -> list[str]:
    """The `@idempotent` rows of a SQL store (x1), beside its store verbs, the raw driver and
    the floors."""
    subjects = ("raw", *FLOORS, "oncely", "oncely @idempotent")
    if not results.get(store, MODES[0], "cycle", subjects[-1]):
        return []
    lines = [
        f"### {store}: decorated function, x1",
        "",
        "The payment function decorated by `@idempotent` (default policy: JSON codec, "
        "fingerprint of all arguments, heartbeat; sync, and async with an async function) on "
        "this store, next to the store verbs, the raw driver and (PostgreSQL) the floors of "
        "the same rounds. A floor is the driver's cheapest honest way to make the raw "
        "reference's round trips: one plain connection, statements prepared on the server "
        "(psycopg's `prepare=True` on a kept cursor; asyncpg's statement cache), one sequential "
        "worker (`benchmarks/stores/floors.py`).",
        "",
        "| mode | operation | subject | ops/s | p50 µs | p99 µs | ratio to raw (IQR) "
        "| ratio to psycopg floor | ratio to asyncpg floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, op in itertools.product((MODES[0], MODES[2]), OPS):
        raw = results.get(store, mode, op, "raw")
        floors = [results.get(store, mode, op, floor) for floor in FLOORS]
        for subject in subjects:
            samples = results.get(store, mode, op, subject)
            if not samples:
                continue
            label = {"oncely": "oncely store verbs", "raw": raw_label(store)}.get(subject, subject)
            to_floors = " | ".join(
                _ratio_cell(ratios(samples, floor)) if floor else "-" for floor in floors
            )
            lines.append(
                f"| {mode} | {OP_LABELS[op]} | {label} "
                f"| {_n(median_of(samples, 'ops_per_s'))} | {_us(median_of(samples, 'p50_us'))} "
                f"| {_us(median_of(samples, 'p99_us'))} | {_ratio_cell(ratios(samples, raw))} "
                f"| {to_floors} |"
            )
    return [*lines, ""]


def raw_label(store: str) -> str:
    """The raw reference's name in a table: on Redis it is the floor as well."""
    if store.startswith("Redis"):
        return "raw = floor (pooled redis-py, hiredis)" if _hiredis() else "raw (no hiredis)"
    return "raw (pool)" if store == "PostgreSQL" else "raw"


def _hiredis() -> bool:
    try:
        importlib.metadata.version("hiredis")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def sql_decorator_verdicts(results: Results, store: str, verdicts: list[Verdict]) -> None:
    """The targets of the decorator rows (`sql_target`; `TARGET_FLOOR` over the fastest
    floor)."""
    for mode, op in itertools.product((MODES[0], MODES[2]), OPS):
        raw = results.get(store, mode, op, "raw")
        mine = results.get(store, mode, op, "oncely @idempotent")
        if raw and mine:
            value = statistics.median(ratios(mine, raw))
            target = sql_target(store, op)
            verdicts.append(Verdict(f"{store}, {mode}, {op}: @idempotent/raw", value, target))
        floor = fastest_floor(results, store, mode, op)
        if floor is not None and mine:
            value = statistics.median(ratios(mine, results.get(store, mode, op, floor)))
            verdicts.append(
                Verdict(f"{store}, {mode}, {op}: @idempotent/{floor}", value, TARGET_FLOOR[mode])
            )


def bench_sqlite(run_id: str, results: Results, keys: Keys, ops: int, rounds: int) -> None:
    """The SQLite store against raw sqlite3, once per `SQLITE_SYNCHRONOUS` setting."""
    for synchronous in SQLITE_SYNCHRONOUS:
        label = f"SQLite ({synchronous})"
        _log(f"{label}: {rounds} rounds of {ops} operations per subject")
        try:
            with sqlite_plan(run_id, synchronous) as plan:
                bench_plan(plan, results, keys, ops, rounds)
        except Exception as exc:
            results.failures[label] = f"{type(exc).__name__}: {exc}"
            for key in [key for key in results.samples if key[0] == label]:
                del results.samples[key]
            _log(f"{label}: FAILED\n{traceback.format_exc()}")


TARGET_SQLITE_REPLAY = 0.5
"""The hot-path issue's target for a SQLite replay (the others are `TARGET_RATIO`)."""


def sql_target(store: str, op: str) -> float:
    """The target ratio to raw of *op* on *store*."""
    return TARGET_SQLITE_REPLAY if store.startswith("SQLite") and op == "replay" else TARGET_RATIO


def probe(servers: Servers, wanted: Sequence[str]) -> dict[str, str]:
    """Which servers answer: store name -> '' if up, else why not. Records server versions."""
    status: dict[str, str] = {}
    if "redis" in wanted or "cluster" in wanted:
        import redis

    if "redis" in wanted:
        try:
            client = redis.Redis.from_url(servers.redis_url, socket_connect_timeout=2)
            servers.versions["Redis"] = str(client.info("server")["redis_version"])
            client.close()
            status["redis"] = ""
        except Exception as exc:
            status["redis"] = f"{type(exc).__name__}: {exc}"
    if "cluster" in wanted:
        try:
            cluster = _cluster_client(
                servers.cluster_url, "redis.cluster", socket_connect_timeout=2
            )
            info = cluster.info("server", target_nodes=cluster.PRIMARIES)
            versions = sorted({str(each["redis_version"]) for each in info.values()})
            servers.versions["Redis Cluster"] = f"{', '.join(versions)} ({len(info)} primaries)"
            cluster.close()
            status["cluster"] = ""
        except Exception as exc:
            status["cluster"] = f"{type(exc).__name__}: {exc}"
    if "postgres" in wanted:
        try:
            import psycopg

            with psycopg.connect(servers.postgres_url, connect_timeout=2) as connection:
                row = connection.execute("SHOW server_version").fetchone()
                servers.versions["PostgreSQL"] = str(row[0] if row else "?")
            status["postgres"] = ""
        except Exception as exc:
            status["postgres"] = f"{type(exc).__name__}: {exc}"
    return status


# -- the report --------------------------------------------------------------------------------


def machine() -> list[str]:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as info:
        memory = f"{int(info.readline().split()[1]) // 1024 // 1024} GiB RAM"
    return [
        f"{platform.system()} {platform.release()} {platform.machine()}, CPU: {cpu}, "
        f"{os.cpu_count()} cores, {memory}",
        f"Python {platform.python_version()} ({platform.python_implementation()})",
    ]


def package_versions() -> str:
    names = ["oncely", "redis", "hiredis", "psycopg", "psycopg-binary", "psycopg-pool"]
    names.append("aws-lambda-powertools")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            if name == "hiredis":
                found.append("no hiredis (redis-py's pure-Python parser)")
    return ", ".join(found)


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


def store_table(results: Results, store: str, verdicts: list[Verdict]) -> list[str]:
    lines = [
        "| mode | operation | raw ops/s | raw p50 µs | raw p99 µs | oncely ops/s "
        "| oncely p50 µs | oncely p99 µs | oncely/raw (IQR) | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        for op in OPS:
            raw = results.get(store, mode, op, "raw")
            mine = results.get(store, mode, op, "oncely")
            if not raw or not mine:
                continue
            per_round = ratios(mine, raw)
            value = statistics.median(per_round)
            target = sql_target(store, op)
            verdicts.append(Verdict(f"{store}, {mode}, {op}: oncely/raw", value, target))
            lines.append(
                f"| {mode} | {OP_LABELS[op]} "
                f"| {_n(median_of(raw, 'ops_per_s'))} | {_us(median_of(raw, 'p50_us'))} "
                f"| {_us(median_of(raw, 'p99_us'))} "
                f"| {_n(median_of(mine, 'ops_per_s'))} | {_us(median_of(mine, 'p50_us'))} "
                f"| {_us(median_of(mine, 'p99_us'))} "
                f"| {_ratio_cell(per_round)} | ≥ {target:g}: {_verdict(value, target)} |"
            )
    return lines


def tiered_table(results: Results, verdicts: list[Verdict]) -> list[str]:
    lines = [
        "| mode | raw GET ops/s | raw p50 µs | raw p99 µs | tiered replay ops/s "
        "| tiered p50 µs | tiered p99 µs | tiered/raw GET (IQR) | target ≥ 20x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        raw = results.get("Redis", mode, "replay", "raw")
        tiered = results.get("Redis", mode, "replay", "oncely tiered")
        if not raw or not tiered:
            continue
        per_round = ratios(tiered, raw)
        value = statistics.median(per_round)
        verdicts.append(Verdict(f"Redis, {mode}: tiered replay / raw GET", value, TARGET_TIERED))
        lines.append(
            f"| {mode} | {_n(median_of(raw, 'ops_per_s'))} | {_us(median_of(raw, 'p50_us'))} "
            f"| {_us(median_of(raw, 'p99_us'))} | {_n(median_of(tiered, 'ops_per_s'))} "
            f"| {_us(median_of(tiered, 'p50_us'))} | {_us(median_of(tiered, 'p99_us'))} "
            f"| {_ratio_cell(per_round, 1)} | {_verdict(value, TARGET_TIERED)} |"
        )
    return lines


def decorator_table(results: Results) -> list[str]:
    subjects = ["raw", "oncely", "oncely @idempotent", "Powertools idempotent_function"]
    if not results.get("Redis", MODES[0], "cycle", subjects[2]):
        return []
    lines = [
        "| mode | operation | subject | round trips | ops/s | p50 µs | p99 µs "
        "| ratio to raw (IQR) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    trips = {
        ("cycle", "raw"): "2",
        ("cycle", "oncely"): "2",
        ("cycle", "oncely @idempotent"): "2",
        ("cycle", "Powertools idempotent_function"): "2",
        ("replay", "raw"): "1",
        ("replay", "oncely"): "1",
        ("replay", "oncely @idempotent"): "1",
        ("replay", "Powertools idempotent_function"): "3",
    }
    for mode, op in itertools.product((MODES[0], MODES[2]), OPS):
        raw = results.get("Redis", mode, op, "raw")
        for subject in subjects:
            samples = results.get("Redis", mode, op, subject)
            if not samples:
                continue
            label = "oncely store verbs" if subject == "oncely" else subject
            lines.append(
                f"| {mode} | {OP_LABELS[op]} | {label} | {trips[(op, subject)]} "
                f"| {_n(median_of(samples, 'ops_per_s'))} | {_us(median_of(samples, 'p50_us'))} "
                f"| {_us(median_of(samples, 'p99_us'))} | {_ratio_cell(ratios(samples, raw))} |"
            )
    return lines


def decorator_section(results: Results, note: str) -> list[str]:
    lines = ["## Decorated function, Redis, x1 (reference)", ""]
    lines += [f"Note: {each}\n" for each in results.notes.get("Redis", [])]
    table = decorator_table(results)
    if not table:
        return [*lines, f"Not measured: {note or 'Redis was not measured'}"]
    if note:
        lines += [f"Powertools: not measured ({note.split(':')[0]}).", ""]
    return [
        *lines,
        "The same payment function decorated by oncely's `@idempotent` (default policy: JSON "
        "codec, fingerprint of all arguments, heartbeat; sync, and async with an async "
        "function) and (sync) by AWS Powertools' "
        "`idempotent_function` with `CachePersistenceLayer` (its Redis layer: key JMESPath, "
        "in-progress expiry from a stand-in Lambda context, no local cache), next to the store "
        "verbs and the raw driver of the same rounds. Powertools runs without "
        "`payload_validation_jmespath`: its Redis layer drops the payload hash when it "
        "completes a record, so with validation on, every replay fails with "
        "`IdempotencyValidationError` (aws-lambda-powertools 3.37). Its replay costs 3 round "
        "trips: the `SET NX` that fails, then two `GET`s.",
        "",
        *table,
    ]


def render(
    results: Results,
    context: dict[str, Any],
    memory: MemoryFigures | None = None,
    cpu: ServerCpu | None = None,
) -> str:
    verdicts: list[Verdict] = []
    lines = [
        "# Store benchmark",
        "",
        f"Generated by `{context['command']}` on {context['started']} "
        f"({context['elapsed']:.0f} s).",
        "",
        "## Machine",
        "",
        f"- run: `{context['command']}`, {context['started']}, {context['elapsed']:.0f} s",
        *[f"- {line}" for line in context["machine"]],
        f"- servers (loopback): {context['servers']}",
        f"- packages: {context['packages']}",
        f"- load average at start: {context['load_start']}; at the end: {context['load_end']} "
        "(the machine is shared with other work)",
        "",
        "## Method",
        "",
        f"Each subject ran {context['ops']:,} operations per measurement, in "
        f"{context['rounds']} rounds of {context['per_round']:,} interleaved with the other "
        "subjects' (the order rotates each round, so a slow moment of the shared machine falls "
        "on a pair of neighbouring runs), after a warm-up round that fills the pools, loads "
        "the scripts and prepares the statements. A cycle is a claim then a complete of a new "
        "key; a replay is a claim of a key the cycle just completed (its answer carries the "
        f"{len(RESULT)}-byte result). `x1` is one worker; `x{CONCURRENCY}` is {CONCURRENCY} "
        "threads (sync) or asyncio tasks (async) sharing the store, and the same for the raw "
        "driver: redis-py's connection pool (the async client in the event loop), and "
        "`psycopg_pool` pools of oncely's default sizes (1 to 10 connections) with one "
        "checkout per statement. Raw Redis is `SET NX PX` + `SET EX` (cycle) and `GET` "
        "(replay); raw PostgreSQL is `INSERT … ON CONFLICT DO NOTHING RETURNING` + `UPDATE` "
        "(cycle) and `SELECT` (replay) on a table shaped like oncely's. On Redis the raw "
        "reference is also the floor (the driver's cheapest honest way: a pooled redis-py "
        "client with hiredis); on PostgreSQL the floors, measured x1 beside it, are plain "
        "connections with prepared statements (psycopg sync and async, asyncpg). Throughput and "
        "latencies are medians over the rounds; a ratio is the median of the per-round "
        "ratios, with their interquartile range in brackets (its width is the noise). The "
        f"tiered store's timed runs go over their keys {TIERED_REPEAT} times (a replay from "
        "memory takes microseconds).",
        "",
    ]
    lines += sql_method_note(context["stores"])
    if memory is not None:
        lines += memory_sections(memory, verdicts)
    for store in context["stores"]:
        lines += [f"## {store}", ""]
        if store in results.failures:
            lines += [f"Not measured: {results.failures[store]}", ""]
            continue
        lines += [*store_table(results, store, verdicts), ""]
        lines += sql_decorator_section(results, store)
        sql_decorator_verdicts(results, store, verdicts)
    tiered = tiered_table(results, verdicts)
    if len(tiered) > 2:
        lines += [
            "## Tiered store replay (`tiered+redis://`) against the raw Redis `GET`",
            "",
            "The tiered store answers a replay of a cached completed record from process "
            "memory, without a round trip.",
            "",
            *tiered,
            "",
        ]
    if "Redis" in context["stores"]:
        lines += [*decorator_section(results, context.get("powertools_note", "")), ""]
    if cpu is not None:
        lines += server_cpu_section(cpu, verdicts)
    lines += ["## Targets", ""]
    if not verdicts:
        lines.append("- nothing was measured")
    for verdict in verdicts:
        if verdict.at_most:
            met = "met" if verdict.value <= verdict.target else "**MISSED**"
            lines.append(f"- {verdict.what} ≤ {verdict.target:g}: {verdict.value:.1f} ({met})")
            continue
        unit = "x" if verdict.target == TARGET_TIERED else ""
        digits = 3 if verdict.what.startswith("memory") else 2
        lines.append(
            f"- {verdict.what} ≥ {verdict.target:g}{unit}: {verdict.value:.{digits}f}{unit} "
            f"({_verdict(verdict.value, verdict.target)})"
        )
    for store, reason in results.failures.items():
        lines.append(f"- {store}: not measured ({reason.splitlines()[0]})")
    return "\n".join(lines) + "\n"


def _sections(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The lines before the first ``## `` heading, and each section's lines by title."""
    head: list[str] = []
    sections: dict[str, list[str]] = {}
    current = head
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        else:
            current.append(line)
    return head, sections


def merged(earlier: str, report: str) -> str:
    """*report*, with the sections of the *earlier* report it lacks carried over in their
    places (and their lines of the targets), named as such in the Machine section."""
    old_head, old = _sections(earlier)
    head, new = _sections(report)
    carried = [title for title in old if title not in new and title != "Targets"]
    if not carried:
        return report
    measured = {line[2:].split(",")[0] for line in new.get("Targets", []) if line.startswith("- ")}
    measured |= {title for title in new if title != "Targets"}
    targets = [line for line in new.get("Targets", []) if line.strip()]
    targets += [
        line
        for line in old.get("Targets", [])
        if line.startswith("- ") and line[2:].split(",")[0] not in measured
    ]
    earlier_run = next((line for line in old_head if line.startswith("Generated by")), "")
    note = (
        f"- carried over from the earlier report, not measured by this run: "
        f"{', '.join(carried)}. {earlier_run.replace('Generated by', 'That report was made by')}"
    )
    older = next((line for line in old.get("Machine", []) if line.startswith("- carried")), "")
    if older:  # the earlier report carried sections of its own
        note += f" In it, {older[2:]}"
    machine = new.get("Machine", [])
    while machine and not machine[-1].strip():
        machine.pop()
    new["Machine"] = [*machine, note, ""]
    order = [title for title in old if title != "Targets"]
    order += [title for title in new if title not in order and title != "Targets"]
    lines = [*head]
    for title in order:
        lines += [f"## {title}", *(new[title] if title in new else old[title])]
    lines += ["## Targets", "", *targets]
    return "\n".join(lines).rstrip("\n") + "\n"


# -- main --------------------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer operations and rounds")
    parser.add_argument(
        "--ops",
        type=int,
        help="operations per subject and measurement, split over the rounds (default 6000; "
        "1200 with --quick)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds; figures are medians over them (default 20; 6 with --quick)",
    )
    parser.add_argument(
        "--stores",
        nargs="+",
        choices=["memory", "redis", "postgres", "cluster", "sqlite", "cpu"],
        default=["memory", "redis", "postgres", "cluster", "sqlite", "cpu"],
        help="what to measure (--stores postgres sqlite: the SQL stores alone; cpu: Redis "
        "server time per transition, on a private redis-server started on --cpu-port)",
    )
    parser.add_argument(
        "--cpu-port",
        type=int,
        default=7401,
        help="a free loopback port for the private redis-server of --stores cpu",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the sections of the existing report that this run does not measure "
        "(named as carried over from the earlier run)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding another oncely's src/, measured beside this one on memory://",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "ONCELY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument(
        "--cluster-url",
        default=os.environ.get(
            "ONCELY_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103",
        ),
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown report")
    args = parser.parse_args(argv)
    args.ops = args.ops or (1200 if args.quick else 6000)
    args.rounds = args.rounds or (6 if args.quick else 20)
    if args.rounds < 1 or args.ops // args.rounds < CONCURRENCY:
        parser.error(f"--ops / --rounds must be at least {CONCURRENCY} operations per round")
    args.per_round = args.ops // args.rounds
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    warnings.simplefilter("ignore", DeprecationWarning)  # third-party deprecations
    run_id = uuid.uuid4().hex[:8]
    started_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    started = time.perf_counter()
    servers = Servers(args.redis_url, args.postgres_url, args.cluster_url)
    status = probe(servers, [name for name in args.stores if name not in ("memory", "cpu")])
    results = Results()
    keys = Keys(run_id)
    context: dict[str, Any] = {}
    labels = {"redis": "Redis", "postgres": "PostgreSQL", "cluster": "Redis Cluster"}
    memory: MemoryFigures | None = None
    cpu: ServerCpu | None = None
    if "memory" in args.stores:
        memory = bench_memory(args.rounds, max(args.per_round, 2000), args.baseline)
    if "cpu" in args.stores:
        try:
            cpu = bench_server_cpu(
                min(args.rounds, 7), max(args.per_round, 2000), args.baseline, args.cpu_port
            )
        except Exception as exc:
            results.failures["Redis server CPU"] = f"{type(exc).__name__}: {exc}"
            _log(f"Redis server CPU: FAILED\n{traceback.format_exc()}")
    for name in [name for name in args.stores if name not in ("memory", "cpu", "sqlite")]:
        label = labels[name]
        if status.get(name):
            results.failures[label] = f"the server did not answer: {status[name]}"
            _log(f"{label}: skipped ({status[name]})")
            continue
        _log(f"{label}: {args.rounds} rounds of {args.per_round} operations per subject")
        try:
            if name == "postgres":
                with postgres_plan(servers, run_id) as plan:
                    bench_plan(plan, results, keys, args.per_round, args.rounds)
            else:
                cluster = name == "cluster"
                with redis_plan(servers, run_id, args.per_round, cluster=cluster) as plan:
                    if name == "redis":
                        context["powertools_note"] = plan.note
                    bench_plan(plan, results, keys, args.per_round, args.rounds)
        except Exception as exc:
            results.failures[label] = f"{type(exc).__name__}: {exc}"
            for key in [key for key in results.samples if key[0] == label]:
                del results.samples[key]
            _log(f"{label}: FAILED\n{traceback.format_exc()}")
    if "sqlite" in args.stores:
        bench_sqlite(run_id, results, keys, args.per_round, args.rounds)
    context.update(
        command=shlex.join(["python", "benchmarks/stores/bench_stores.py", *argv]),
        started=started_at,
        elapsed=time.perf_counter() - started,
        machine=machine(),
        servers=", ".join(f"{name} {version}" for name, version in servers.versions.items())
        or "none answered",
        packages=package_versions(),
        load_start=load_start,
        load_end=" ".join(f"{x:.1f}" for x in os.getloadavg()),
        ops=args.ops,
        rounds=args.rounds,
        per_round=args.per_round,
        stores=[labels[name] for name in args.stores if name not in ("memory", "cpu", "sqlite")]
        + [f"SQLite ({each})" for each in SQLITE_SYNCHRONOUS if "sqlite" in args.stores],
    )
    report = render(results, context, memory, cpu)
    if args.update and args.output.exists():
        report = merged(args.output.read_text(), report)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    _log(f"written to {args.output}")
    return 1 if results.failures and not results.samples else 0


if __name__ == "__main__":
    sys.exit(main())
