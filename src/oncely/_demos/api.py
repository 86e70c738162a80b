"""The HTTP demo: a payments API on a real socket, a retry storm, and dropped responses.

``run_http_demo(args)`` (wired into ``python -m oncely.demo --http``; also runnable as
``python -m oncely._demos.api``) starts a payments API in a child process: a bare ASGI app
served by uvicorn on loopback, behind `oncely.http.asgi.IdempotencyMiddleware` on a SQLite
store. In front of it runs a small TCP proxy that drops a share of the responses: the server
has answered, the client never hears it, as when a connection dies on the way back. Client
threads then create every payment several times at once (double submissions from one client),
each through `oncely.http.client.IdempotentTransport`, which keys the request once and retries
it on the dropped connection, on 409 (the first copy still running) and on 503.

At the end the bank's ledger (a SQLite file the API appends one row per charge to, with the
fencing token of the lease that charged) is checked: every payment charged exactly once.
``--unsafe`` serves the same API without the middleware, to show the check failing. Needs
uvicorn and httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import queue
import random
import socket
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oncely._demos._common import positive_int, rate_below_one

__all__ = ["build_http_parser", "main", "run_http_demo"]

EXIT_OK = 0
EXIT_LEDGER_FAILED = 1
EXIT_ABORTED = 3

LEASE_SECONDS = 1.0
"""The server's lease: short, so a copy left by a dropped connection is taken over soon."""

_LEDGER_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run TEXT NOT NULL,
    payment_id TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    fencing_token INTEGER
)
"""


@dataclass(frozen=True)
class Settings:
    """The demo's options, read from the main demo's namespace or the HTTP demo's own."""

    payments: int = 100
    attempts: int = 4
    clients: int = 16
    drop_rate: float = 0.25
    seed: int = 1
    db: Path | None = None
    quiet: bool = False
    json: bool = False
    unsafe: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Take what *args* has; ``threads`` (the main demo's option) sets the client count."""
        defaults = cls()
        clients = getattr(args, "clients", None) or getattr(args, "threads", None)
        drop_rate = getattr(args, "drop_rate", None)
        return cls(
            payments=int(getattr(args, "payments", defaults.payments)),
            attempts=int(getattr(args, "attempts", defaults.attempts)),
            clients=int(clients or defaults.clients),
            drop_rate=float(defaults.drop_rate if drop_rate is None else drop_rate),
            seed=int(getattr(args, "seed", defaults.seed)),
            db=getattr(args, "db", None),
            quiet=bool(getattr(args, "quiet", False)),
            json=bool(getattr(args, "json", False)),
            unsafe=bool(getattr(args, "unsafe", False)),
        )


# -- the server (child process) ---------------------------------------------------------------


def _payments_app(ledger_path: str, run: str, seed: int) -> Any:
    """A bare ASGI payments API: ``POST /payments`` charges by appending a ledger row."""
    import oncely

    bank = sqlite3.connect(ledger_path, timeout=30, isolation_level=None)
    bank.execute("PRAGMA journal_mode=WAL")
    work = random.Random(seed)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if scope["method"] != "POST" or scope["path"] != "/payments":
            await _send_json(send, 404, {"error": "not found"})
            return
        payment = json.loads(body)
        await asyncio.sleep(work.uniform(0.005, 0.03))  # the bank's latency
        lease = oncely.current_lease()
        cursor = bank.execute(
            "INSERT INTO ledger (run, payment_id, amount_cents, fencing_token) VALUES (?, ?, ?, ?)",
            (run, payment["payment_id"], payment["amount_cents"], lease.token if lease else None),
        )
        await _send_json(send, 201, {"charge": cursor.lastrowid, **payment})

    return app


async def _send_json(send: Any, status: int, document: dict[str, Any]) -> None:
    body = json.dumps(document).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _serve(
    address: multiprocessing.connection.Connection,
    store_url: str,
    ledger_path: str,
    run: str,
    unsafe: bool,
    seed: int,
) -> None:
    """Child process: serve the payments API on a free loopback port, sent back on *address*."""
    import uvicorn

    import oncely
    from oncely.http import HttpPolicy
    from oncely.http.asgi import IdempotencyMiddleware

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without
    # it, a response written in two parts waits out the client's delayed ACK (about 40 ms).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    store = oncely.open_store(store_url, namespace=run, synchronous="normal")
    app = _payments_app(ledger_path, run, seed)
    if not unsafe:
        app = IdempotencyMiddleware(app, store=store, policy=HttpPolicy(lease=LEASE_SECONDS))
    address.send(sock.getsockname()[1])
    address.close()
    try:
        config = uvicorn.Config(app, log_level="error", lifespan="off", access_log=False)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        store.close()


# -- the lossy network -----------------------------------------------------------------------


@dataclass
class ProxyTally:
    """What the proxy saw: responses by status and responses it dropped."""

    statuses: Counter[int] = field(default_factory=Counter)
    dropped: int = 0


class DroppingProxy:
    """A TCP proxy on loopback that forwards requests and drops a share of the responses.

    A dropped response is the server's complete answer thrown away, and the client's connection
    closed: the client sees the connection die without an answer, as when a network fails on the
    way back.
    """

    def __init__(self, upstream: tuple[str, int], drop_rate: float, seed: int) -> None:
        self.upstream = upstream
        self.drop_rate = drop_rate
        self.tally = ProxyTally()
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="oncely-demo-proxy", daemon=True)
        self.port = 0

    def __enter__(self) -> DroppingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            server.close()
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        awaiting = [False]  # a request went up and its response has not started yet

        async def upstream() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    awaiting[0] = True
                    up_writer.write(data)
                    await up_writer.drain()

        async def downstream() -> None:
            with contextlib.suppress(OSError):
                while data := await up_reader.read(65536):
                    if awaiting[0]:
                        awaiting[0] = False
                        status = data[9:12]
                        if status.isdigit():
                            self.tally.statuses[int(status)] += 1
                        if self._random.random() < self.drop_rate:
                            self.tally.dropped += 1
                            return  # the answer is lost: close both sides
                    writer.write(data)
                    await writer.drain()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in (writer, up_writer):
            stream.close()
            with contextlib.suppress(OSError):
                await stream.wait_closed()


# -- the storm (client threads) ----------------------------------------------------------------


@dataclass
class ClientTally:
    """What the clients saw."""

    requests: int = 0
    attempts: int = 0
    executed: int = 0
    replayed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)


def payment_id(number: int) -> str:
    """The demo's name for payment *number*."""
    return f"pay-{number:04d}"


def _jobs(settings: Settings) -> list[int]:
    """Every payment *attempts* times, in shuffled rounds; one payment in ten is also sent twice
    in a row (a double submission), so copies of it run at the same time and meet 409."""
    rng = random.Random(settings.seed)
    jobs: list[int] = []
    for round_number in range(settings.attempts):
        round_ = list(range(settings.payments))
        rng.shuffle(round_)
        for job in round_:
            jobs.append(job)
            if round_number == 0 and settings.attempts > 1 and rng.random() < 0.1:
                jobs.append(job)
    if settings.attempts > 1:  # the doubles count towards the payment's submissions
        doubled = Counter(jobs)
        seen: Counter[int] = Counter()
        kept = []
        for job in reversed(jobs):
            seen[job] += 1
            if doubled[job] > settings.attempts and seen[job] == 1:
                continue  # drop one late copy of each doubled payment
            kept.append(job)
        jobs = kept[::-1]
    return jobs


def _storm(settings: Settings, url: str, run: str) -> ClientTally:
    import httpx

    from oncely.http.client import ATTEMPTS_EXTENSION, IdempotentTransport

    work: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    for job in _jobs(settings):
        work.put(job)
    tally = ClientTally()
    lock = threading.Lock()

    def client(number: int) -> None:
        transport = IdempotentTransport(
            httpx.HTTPTransport(),
            max_attempts=12,
            max_elapsed=60,
            backoff=0.02,
            max_backoff=0.5,
            seed=settings.seed * 1000 + number,
        )
        with httpx.Client(transport=transport, base_url=url, timeout=10) as http:
            while (job := work.get()) is not None:
                key = f"{run}:{payment_id(job)}"
                body = {"payment_id": payment_id(job), "amount_cents": 100 + job}
                try:
                    reply = http.post("/payments", json=body, headers={"Idempotency-Key": key})
                except httpx.HTTPError as exc:
                    with lock:
                        tally.requests += 1
                        tally.errors += 1
                        tally.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                with lock:
                    tally.requests += 1
                    tally.attempts += int(reply.extensions.get(ATTEMPTS_EXTENSION, 1))
                    if reply.status_code != 201:
                        tally.errors += 1
                        tally.error_samples.append(
                            f"status {reply.status_code}: {reply.text}"[:200]
                        )
                    elif reply.headers.get("idempotent-replayed") == "true":
                        tally.replayed += 1
                    else:
                        tally.executed += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(settings.clients)]
    for thread in threads:
        work.put(None)
        thread.start()
    for thread in threads:
        thread.join()
    return tally


# -- running it -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerCheck:
    """The verdict on the bank's ledger."""

    ok: bool
    charges: int
    duplicates: int
    missing: int
    line: str


def check_ledger(ledger_path: str, run: str, payments: int) -> LedgerCheck:
    """Every payment of *run* charged exactly once?"""
    connection = sqlite3.connect(ledger_path, timeout=30)
    try:
        rows = connection.execute("SELECT payment_id FROM ledger WHERE run = ?", (run,)).fetchall()
    finally:
        connection.close()
    charged = Counter(row[0] for row in rows)
    expected = {payment_id(n) for n in range(payments)}
    duplicates = sum(count - 1 for count in charged.values() if count > 1)
    missing = len(expected - set(charged))
    ok = duplicates == 0 and missing == 0 and set(charged) == expected
    if ok:
        line = f"ledger check: OK - {payments} payments, each charged exactly once"
    else:
        line = (
            f"ledger check: FAILED - {len(rows)} charges for {payments} payments: "
            f"{duplicates} duplicate charges, {missing} payments never charged"
        )
    return LedgerCheck(ok, len(rows), duplicates, missing, line)


@contextlib.contextmanager
def _server(store_url: str, ledger: str, run: str, settings: Settings) -> Iterator[int]:
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_serve,
        args=(sender, store_url, ledger, run, settings.unsafe, settings.seed),
        name="oncely-demo-api",
    )
    process.start()
    sender.close()
    try:
        if not receiver.poll(60):
            raise RuntimeError("the payments API did not start")
        port = int(receiver.recv())
        yield port
    finally:
        receiver.close()
        process.terminate()
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join()
        process.close()


def run_http_demo(args: argparse.Namespace) -> int:
    """Run the HTTP demo; return 0 when the ledger check passes, 1 when it fails, 3 if aborted.

    *args* is the demo's parsed options (`build_http_parser`, or ``python -m oncely.demo``'s own:
    ``payments``, ``attempts``, ``threads`` as the client count, ``seed``, ``db``, ``quiet``,
    ``json``, ``unsafe``, and ``drop_rate`` when present).
    """
    settings = Settings.from_args(args)
    try:
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"the HTTP demo needs uvicorn and httpx ({exc.name} is missing): "
              "pip install 'oncely[httpx]' uvicorn", file=sys.stderr)  # fmt: skip
        return EXIT_ABORTED
    if settings.db is not None:
        db_path = Path(settings.db).resolve()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        return _run(settings, db_path, temporary=False)
    with tempfile.TemporaryDirectory(prefix="oncely-http-demo-") as directory:
        return _run(settings, Path(directory) / "oncely.db", temporary=True)


def _run(settings: Settings, db_path: Path, *, temporary: bool) -> int:
    run = f"http-demo-{uuid.uuid4().hex[:8]}"
    ledger = str(db_path.with_name(f"{db_path.stem}.bank{db_path.suffix or '.db'}"))
    with contextlib.closing(sqlite3.connect(ledger)) as bank:
        bank.execute("PRAGMA journal_mode=WAL")
        bank.executescript(_LEDGER_SCHEMA)
    store_url = f"sqlite:///{db_path}"
    if not settings.unsafe:  # create the schema before the server opens the store
        import oncely

        oncely.open_store(store_url).close()
    if not (settings.quiet or settings.json):
        print(_header(settings, "a temporary directory" if temporary else str(db_path.parent)))
    logging.getLogger("oncely.http.client").setLevel(logging.WARNING)
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            port = stack.enter_context(_server(store_url, ledger, run, settings))
            proxy = stack.enter_context(
                DroppingProxy(("127.0.0.1", port), settings.drop_rate, settings.seed)
            )
            tally = _storm(settings, f"http://127.0.0.1:{proxy.port}", run)
    except RuntimeError as exc:
        print(f"demo aborted: {exc}", file=sys.stderr)
        return EXIT_ABORTED
    elapsed = time.monotonic() - started
    check = check_ledger(ledger, run, settings.payments)
    summary = {
        "mode": "unsafe" if settings.unsafe else "oncely",
        "transport": "http",
        **{name: value for name, value in asdict(settings).items() if name != "db"},
        "run": run,
        "store": str(db_path),
        "bank": ledger,
        "temporary": temporary,
        "requests": tally.requests,
        "http_attempts": tally.attempts,
        "responses_dropped": proxy.tally.dropped,
        "conflicts_409": proxy.tally.statuses.get(409, 0),
        "responses_by_status": {str(k): v for k, v in sorted(proxy.tally.statuses.items())},
        "executed_responses": tally.executed,
        "replayed_responses": tally.replayed,
        "errors": tally.errors,
        "error_samples": tally.error_samples[:5],
        "charges": check.charges,
        "duplicates": check.duplicates,
        "missing": check.missing,
        "ledger_ok": check.ok,
        "ledger_check": check.line,
        "elapsed_seconds": round(elapsed, 3),
    }
    if settings.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_render(summary))
        print()
        print(check.line)
    return EXIT_OK if check.ok else EXIT_LEDGER_FAILED


def _header(settings: Settings, where: str) -> str:
    guard = "WITHOUT oncely (--unsafe)" if settings.unsafe else "behind oncely's ASGI middleware"
    return (
        f"oncely HTTP demo: POST /payments served by uvicorn, {guard}\n"
        f"  {settings.payments} payments x {settings.attempts} submissions | {settings.clients} "
        f"client threads with IdempotentTransport | {settings.drop_rate * 100:g}% of responses "
        f"dropped (seed {settings.seed})\n"
        f"  oncely store and bank ledger: SQLite files in {where}\n"
    )


def _render(summary: dict[str, Any]) -> str:
    rows = [
        ("logical requests", summary["requests"], "payments x submissions"),
        ("HTTP attempts", summary["http_attempts"], "the transport's retries included"),
        ("responses dropped", summary["responses_dropped"], "answered, but never heard"),
        ("409 in progress", summary["conflicts_409"], "a copy was still running: retried"),
        ("executed answers", summary["executed_responses"], "heard from the first execution"),
        ("replayed answers", summary["replayed_responses"], "Idempotent-Replayed: true"),
        ("errors", summary["errors"], "requests that never got a 201"),
        ("charges in ledger", summary["charges"], f"for {summary['payments']} payments"),
        ("elapsed", f"{summary['elapsed_seconds']:.1f}s", ""),
    ]
    width = max(len(label) for label, _, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value!s:>8}  {note}" for label, value, note in rows)


def build_http_parser() -> argparse.ArgumentParser:
    """The HTTP demo's own options (the main demo passes its namespace instead)."""
    parser = argparse.ArgumentParser(
        prog="python -m oncely._demos.api",
        description="A retry storm over real sockets, with dropped responses, against a "
        "payments API behind oncely's ASGI middleware; checks the bank's ledger.",
    )
    parser.add_argument("--payments", type=positive_int, default=100, help="default: 100")
    parser.add_argument(
        "--attempts", type=positive_int, default=4, help="submissions per payment (default: 4)"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=16, help="concurrent clients (default: 16)"
    )
    parser.add_argument(
        "--drop-rate",
        type=rate_below_one,
        default=0.25,
        help="share of responses lost (default: 0.25)",
    )
    parser.add_argument("--seed", type=int, default=1, help="decides the order and the drops")
    parser.add_argument("--db", type=Path, help="the store's SQLite file (default: a temp dir)")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")
    parser.add_argument("--json", action="store_true", help="print a JSON summary only")
    parser.add_argument("--unsafe", action="store_true", help="serve without oncely")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m oncely._demos.api``: parse the options and run the demo."""
    return run_http_demo(build_http_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
