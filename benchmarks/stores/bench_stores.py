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
  ``SELECT`` of the row; both on a ``psycopg_pool`` pool of oncely's default sizes (1..10);
  beside it (x1), the floors: the same round trips on a plain connection with prepared
  statements, psycopg (sync and async) and asyncpg (`floors`). On Redis the raw reference,
  a pooled redis-py client with hiredis, is the floor itself.

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
The subjects are in `stores_subjects` and `floors`, the report in `stores_report`, what they
share in `stores_common`. Not a test: pytest never collects this directory. Every key, table
and schema it creates is its own (a per-run prefix and schema) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stores_common import (
    ASYNCPG_DECORATED,
    CONCURRENCY,
    FINGERPRINT,
    HERE,
    LEASE,
    MODES,
    OPS,
    RESULT,
    RESULTS,
    ROOT,
    SQLITE_SYNCHRONOUS,
    TIERED_REPEAT,
    TTL,
    BenchError,
    Keys,
    MemoryFigures,
    Results,
    Sample,
    ServerCpu,
    Subject,
    _log,
    run_async,
    run_sync,
)
from stores_report import machine, merged, package_versions, render
from stores_subjects import (
    RAW_TABLE_SQL,
    Decorated,
    OncelySubject,
    RawPostgres,
    RawRedis,
    RawSQLite,
    oncely_decorated,
    powertools_decorated,
)

import oncely

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
            subjects += [each for each in plan.decorated if each.call is not None]
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
    on_asyncpg: Any = None
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
        if not missing:
            on_asyncpg = oncely.open_store(
                servers.postgres_url, namespace="bench", schema=schema, async_driver="asyncpg"
            )
            plan.decorated.append(oncely_decorated(on_asyncpg, ASYNCPG_DECORATED, sync=False))

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
            if on_asyncpg is not None:
                await on_asyncpg.aclose()

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
