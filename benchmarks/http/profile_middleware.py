"""Per-request cost of the ASGI middleware, in process: no server, no sockets, no load generator.

    python benchmarks/http/profile_middleware.py                 # bare app and memory store
    python benchmarks/http/profile_middleware.py --redis         # plus ONCELY_TEST_REDIS_URL
    python benchmarks/http/profile_middleware.py --profile memory-new
    python benchmarks/http/profile_middleware.py --redis --stages    # writes results/http_stages.md

Calls the benchmark's app (``app.py``, no work) directly with ASGI scope / receive / send
callables, one request at a time on one event loop, and reports microseconds per request (wall
and this process's CPU: with a network store, the CPU figure is what a loaded server pays) for
the bare app, the middleware on a unique key per request (claim, run, complete) and the
middleware on a repeated key (replay). ``--profile SCENARIO`` adds a cProfile of that scenario,
top 30 by own time. ``--stages`` times each stage of the middleware's straight line
(`stage_table`) and writes ``benchmarks/results/http_stages.md``, which the docs' performance
page shows. Deterministic and short: meant for comparing two versions of the code and for
saying where the microseconds go, not for the throughput figures (``run.py`` measures those
against a real server).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import payments_app

import oncely
from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware

BODY = b'{"amount":500,"currency":"EUR"}'
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _scope(key: bytes | None) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/payments",
        "raw_path": b"/payments",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _request(app: App, key: bytes | None) -> int:
    status = 0
    message = {"type": "http.request", "body": BODY, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(key), receive, send)
    return status


async def _drive(app: App, keys: list[bytes | None], expected: int) -> tuple[float, float]:
    """Run one request per key; return (wall, CPU) microseconds per request."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    for key in keys:
        status = await _request(app, key)
        if status != expected:
            raise SystemExit(f"unexpected status {status} (expected {expected})")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall / len(keys) * 1e6, cpu / len(keys) * 1e6


def _middleware(url: str) -> IdempotencyMiddleware:
    store = oncely.open_store(url, namespace=f"profile-{uuid.uuid4().hex[:8]}")
    return IdempotencyMiddleware(payments_app(0.0), store=store, policy=HttpPolicy(ttl=600))


async def _scenarios(args: argparse.Namespace) -> dict[str, tuple[App, list[bytes | None], int]]:
    n = args.requests
    run = uuid.uuid4().hex[:8]
    fresh = [f"{run}-{i}".encode() for i in range(n)]
    scenarios: dict[str, tuple[App, list[bytes | None], int]] = {
        "bare": (payments_app(0.0), [None] * n, 201),
    }
    urls = {"memory": "memory://"}
    if args.redis:
        urls["redis"] = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if args.sqlite:
        urls["sqlite"] = f"sqlite:///{tempfile.mkdtemp(prefix='oncely-profile-')}/oncely.db"
    if args.postgres:
        base = os.environ.get(
            "ONCELY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
        )
        urls["postgres"] = f"{base}{'&' if '?' in base else '?'}schema={args.schema}"
        with oncely.open_store(urls["postgres"]) as store:  # type: ignore[attr-defined]
            store.migrate()
    for name, url in urls.items():
        middleware = _middleware(url)
        scenarios[f"{name}-new"] = (middleware, fresh, 201)
        replayed = _middleware(url)
        await _request(replayed, b"replayed")  # the first request stores the response
        scenarios[f"{name}-replay"] = (replayed, [b"replayed"] * n, 201)
    return scenarios


async def main(args: argparse.Namespace) -> None:
    scenarios = await _scenarios(args)
    for app, keys, expected in scenarios.values():  # warm up imports, caches and connections
        await _drive(app, keys[:200], expected)
    print(f"{args.requests} sequential requests each, {sys.version.split()[0]}")
    for name, (app, keys, expected) in scenarios.items():
        runs = []
        for attempt in range(args.repeat):
            if name.endswith("-new"):  # a fresh key per request on every run
                keys = [b"%s-t%d" % (key, attempt) for key in keys]  # type: ignore[str-bytes-safe]
            runs.append(await _drive(app, keys, expected))
        wall, cpu = min(runs, key=lambda run: run[1])
        print(f"  {name:<16} {wall:8.1f} us/request wall {cpu:8.1f} us CPU")
    if args.profile:
        app, keys, expected = scenarios[args.profile]
        if args.profile.endswith("-new"):
            keys = [key + b"-profiled" for key in keys]  # type: ignore[operator]
        profiler = cProfile.Profile()
        profiler.enable()
        await _drive(app, keys, expected)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


# -- µs per stage ------------------------------------------------------------------------------

STAGES = {
    "route": "the route and its policy (`RouteTable.select`, the framework's routing)",
    "key": "the `Idempotency-Key` header read and checked (`decide`)",
    "plan": "the key's scope and the fingerprint of method, path, query and body (`plan`)",
    "claim": "the store's claim (a new key: the lease; a replay: the record)",
    "lease": "the lease, its heartbeat started and stopped",
    "app": "the app, with the capture of its response (the bare app alone: last row)",
    "encode": "the response snapshot and its framing (`stored_outcome`)",
    "complete": "the store's complete",
    "replay": "the duplicate logged, the stored response decoded (`replay`)",
    "answer": "the replayed response sent (`_send_response`)",
    "middleware": "the middleware's own code between the stages above (the body read with it)",
}
"""Every stage timed, in the order of a request: the rows of the table."""


class _Clock:
    """Self time per stage: wrappers around the functions the middleware calls, nested calls
    taken out of their caller's time."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.spent: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._inner: list[int] = []

    def _enter(self) -> int:
        self._inner.append(0)
        return self.clock()

    def _leave(self, stage: str, started: int) -> None:
        elapsed = self.clock() - started
        inner = self._inner.pop()
        self.spent[stage] += elapsed - inner
        if self._inner:
            self._inner[-1] += elapsed

    def sync(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave(stage, started)

        return timed

    def coro(self, stage: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._enter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self._leave(stage, started)

        return timed


def _instrument(middleware: IdempotencyMiddleware, clock: _Clock) -> Callable[[], None]:
    """Wrap the middleware's stages in *clock*; return the function that unwraps them."""
    from oncely import _execution
    from oncely.http import _flow, _semantics, asgi

    patches: list[tuple[Any, str, Any]] = [
        (_semantics, "decide", clock.sync("key", _semantics.decide)),
        (_semantics, "plan", clock.sync("plan", _semantics.plan)),
        (_semantics, "plan_parts", clock.sync("plan", _semantics.plan_parts)),
        (_execution, "acquired", clock.sync("lease", _execution.acquired)),
        (
            _execution,
            "start_async_heartbeat",
            clock.sync("lease", _execution.start_async_heartbeat),
        ),
        (
            _execution,
            "stop_async_heartbeat",
            clock.sync("lease", _execution.stop_async_heartbeat),
        ),
        (_flow, "stored_outcome", clock.sync("encode", _flow.stored_outcome)),
        (_execution, "suppressed", clock.sync("replay", _execution.suppressed)),
        (_flow, "replay", clock.sync("replay", _flow.replay)),
        (asgi, "_send_response", clock.coro("answer", asgi._send_response)),
        (middleware.routes, "select", clock.sync("route", middleware.routes.select)),
        (middleware, "_resolve", clock.sync("route", middleware._resolve)),
        (middleware, "app", clock.coro("app", middleware.app)),
    ]
    if hasattr(_semantics, "decide_key"):  # what the middleware calls once it knows the method
        patches.append((_semantics, "decide_key", clock.sync("key", _semantics.decide_key)))
    calls = middleware._calls
    patches += [
        (calls, "aclaim", clock.coro("claim", calls.aclaim)),
        (calls, "acomplete", clock.coro("complete", calls.acomplete)),
    ]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, wrapper in patches:
        setattr(owner, name, wrapper)

    def undo() -> None:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)  # an instance attribute over a method
            else:
                setattr(owner, name, value)

    return undo


async def _stage_round(
    url: str, scenario: str, n: int, clock_ns: Callable[[], int]
) -> dict[str, float]:
    """µs per request per stage of one round of *n* requests (``new`` or ``replay``)."""
    middleware = _middleware(url)
    run = uuid.uuid4().hex[:8]
    await _request(middleware, b"replayed-" + run.encode())
    keys = [f"{run}-{i}".encode() for i in range(n)]
    if scenario == "replay":
        keys = [b"replayed-" + run.encode()] * n
    await _drive(middleware, [f"warm-{run}-{i}".encode() for i in range(200)], 201)
    clock = _Clock(clock_ns)
    undo = _instrument(middleware, clock)
    try:
        gc.collect()
        started = clock_ns()
        for key in keys:
            await _request(middleware, key)
        total = clock_ns() - started
    finally:
        undo()
    timed = dict(clock.spent)
    timed["middleware"] = total - sum(timed.values())
    timed = {stage: ns / n / 1000 for stage, ns in timed.items()}
    timed["total"] = total / n / 1000
    return timed


async def _bare_round(n: int, clock_ns: Callable[[], int]) -> float:
    app = payments_app(0.0)
    await _drive(app, [None] * 200, 201)
    gc.collect()
    started = clock_ns()
    for _ in range(n):
        await _request(app, None)
    return (clock_ns() - started) / n / 1000


def stage_table(columns: dict[str, dict[str, float]], bare: dict[str, float]) -> list[str]:
    """The Markdown table of µs per stage (rows) per subject (columns)."""
    names = list(columns)
    lines = [
        "| stage | what | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for stage, what in STAGES.items():
        cells = [columns[name].get(stage, 0.0) for name in names]
        if not any(cell >= 0.05 for cell in cells):
            continue
        shown = " | ".join(f"{cell:.1f}" if cell >= 0.05 else "" for cell in cells)
        lines.append(f"| {stage} | {what} | {shown} |")
    totals = " | ".join(f"**{columns[name]['total']:.1f}**" for name in names)
    lines.append(f"| total | the whole request, in the middleware | {totals} |")
    alone = " | ".join(f"{bare[name.split()[0]]:.1f}" for name in names)
    lines.append(f"| bare app | the same request to the app without the middleware | {alone} |")
    return lines


async def stages(args: argparse.Namespace) -> str:
    """Run the stage rounds, interleaved; return the results file's text."""
    import platform

    subjects = {"memory": "memory://"}
    if args.redis:
        subjects["redis"] = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    clock_ns = time.process_time_ns if args.cpu else time.perf_counter_ns
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rounds: dict[str, list[dict[str, float]]] = {}
    bare_rounds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, url in subjects.items():
            bare_rounds.setdefault(name, []).append(await _bare_round(args.requests, clock_ns))
            for scenario in ("new", "replay"):
                timed = await _stage_round(url, scenario, args.requests, clock_ns)
                rounds.setdefault(f"{name} {scenario}", []).append(timed)
    # The fastest round: on a shared machine the others were slowed by other work (timeit's rule).
    columns = {column: min(runs, key=lambda r: r["total"]) for column, runs in rounds.items()}
    bare = {name: min(values) for name, values in bare_rounds.items()}
    command = " ".join(["python benchmarks/http/profile_middleware.py", *sys.argv[1:]])
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return "\n".join(
        [
            "# Where an HTTP request's time goes in the ASGI middleware",
            "",
            f"Generated by `{command}` on {now}.",
            "",
            "## Machine",
            "",
            f"- run: `{command}`, {now}",
            f"- {platform.system()} {platform.release()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
            f"- load average at start: {load}; at the end: "
            + " ".join(f"{x:.1f}" for x in os.getloadavg())
            + " (the machine is shared)",
            "",
            "## µs per stage per request",
            "",
            "The benchmark's app (`benchmarks/http/app.py`, no work) called in process, one "
            "request at a time, through oncely's ASGI middleware (`HttpPolicy(ttl=600)`): "
            "`POST /payments` with a small JSON body; *new* is a key never seen (claim, run, "
            "complete), *replay* a key already answered. Each stage is the self time of the "
            "function the middleware calls for it, timed by a wrapper put around that function "
            "(nested stages taken out; each wrapper adds about 0.2 µs to *middleware*); "
            "*middleware* is the rest of the request's time. "
            + (
                "This process's CPU time (`process_time`, `--cpu`): what a loaded server pays; "
                "each wrapper costs more than with the wall clock (a CPU clock read is a system "
                "call). "
                if args.cpu
                else "Wall clock (`perf_counter`): with Redis, the claim and the complete include "
                "the round trip to the server. "
            )
            + f"{args.rounds} rounds of {args.requests:,} requests per column, interleaved; each "
            "column is its fastest round (on a shared machine the others were slowed by other "
            "work).",
            "",
            *stage_table(columns, bare),
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", "-n", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario; best kept")
    parser.add_argument("--redis", action="store_true", help="add Redis (ONCELY_TEST_REDIS_URL)")
    parser.add_argument("--sqlite", action="store_true", help="add SQLite (a temporary file)")
    parser.add_argument(
        "--postgres", action="store_true", help="add PostgreSQL (ONCELY_TEST_POSTGRES_URL)"
    )
    parser.add_argument("--profile", metavar="SCENARIO", help="cProfile one scenario")
    parser.add_argument("--stages", action="store_true", help="time the stages; write results")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of --stages")
    parser.add_argument(
        "--cpu", action="store_true", help="time --stages in this process's CPU time, not wall"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "results" / "http_stages.md",
    )
    arguments = parser.parse_args()
    arguments.schema = f"oncely_profile_{uuid.uuid4().hex[:8]}"  # PostgreSQL: dropped at the end
    try:
        if arguments.stages:
            text = asyncio.run(stages(arguments))
            arguments.output.write_text(text)
            print(text)
        else:
            asyncio.run(main(arguments))
    finally:
        if arguments.postgres:
            import psycopg

            postgres = os.environ.get(
                "ONCELY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
            )
            with psycopg.connect(postgres, autocommit=True) as connection:
                connection.execute(f'DROP SCHEMA IF EXISTS "{arguments.schema}" CASCADE')
