"""The end-to-end demo: HTTP → inbox + order + outbox in one transaction → relay → broker →
consumer with its own inbox, with every process crashing at the worst moment.

``python -m oncely.demo --outbox`` runs the whole pipeline on embedded SQLite, in processes:

* **API workers** serve ``POST /orders`` (the standard library's HTTP server). The handler
  claims the request's ``Idempotency-Key`` with `oncely.Inbox`, inserts the order and adds an
  ``order.placed`` event with `oncely.Outbox`, all in ONE SQLite transaction (``shop.db``).
  Client threads send every order, some twice on purpose, and retry with the same key whenever
  the connection dies without an answer.
* A **relay** (`oncely.outbox.Relay`) publishes committed events to the demo's broker: a durable
  queue in a SQLite table (``broker.db``). A publish commits the messages (the broker's
  confirmation); delivery is at least once, with a visibility timeout.
* **Consumers** take messages from the queue and, in one transaction on their own database
  (``warehouse.db``), claim the message's idempotency key (its outbox message id, in the
  ``Idempotency-Key`` header) with an inbox and write the effect, a shipment; then they ack.

Crashes (``os._exit``), at the three points where a crash hurts most, each decided per
``--seed`` by a hash of the order's key or the event's message id:

* an API worker after its transaction committed, before it answered: the client hears nothing
  and retries; the inbox replays the committed order, and no second event is added;
* the relay after the broker confirmed a batch, before it marked it published: the batch is
  published again once the relay's claim on it expires;
* a consumer after its effect committed, before its ack: the broker redelivers after the
  visibility timeout; the consumer's inbox replays, and no second shipment is written.

The parent restarts every crashed process. At the end it checks: each order request made
exactly one order, one event, and one shipment; nothing lost (exit code 1 otherwise).
``--unsafe`` runs the same pipeline and crashes without the two inboxes, to show the check
failing.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import random
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from oncely._demos._common import (
    DemoAborted,
    positive_int,
    rate_below_one,
    render_table,
    say,
)
from oncely._demos.outbox_roles import (
    CRASH_EXIT_CODE,
    DOUBLE_SUBMIT,
    POINTS,
    RUN_TIMEOUT,
    Config,
    api_main,
    consumer_main,
    crash_planned,
    message_id,
    order_key,
    prepare,
    relay_main,
)

__all__ = ["build_outbox_parser", "main", "run_outbox_demo"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ABORTED = 0, 1, 3


@dataclass
class Tally:
    """What the clients saw and the processes reported."""

    requests: int = 0
    http_attempts: int = 0
    double_submits: int = 0
    created: int = 0
    replayed: int = 0
    client_errors: list[str] = field(default_factory=list)
    answers: dict[str, set[int]] = field(default_factory=dict)
    crashes: Counter[str] = field(default_factory=Counter)
    restarts: Counter[str] = field(default_factory=Counter)
    deduplicated: Counter[str] = field(default_factory=Counter)
    shipped: int = 0


@dataclass
class Slot:
    """A running child process as the parent sees it."""

    role: str
    number: int
    process: multiprocessing.process.BaseProcess
    reports: Connection[Any, Any]
    port: int = 0


_TARGETS: dict[str, Callable[[Connection[Any, Any], Config], None]] = {
    "api": api_main,
    "relay": relay_main,
    "consumer": consumer_main,
}


class Pipeline:
    """Starts and restarts the processes, runs the clients, waits until everything drained."""

    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        self.args = args
        self.config = config
        self.context = multiprocessing.get_context("spawn")
        self.slots: list[Slot] = []
        self.tally = Tally()
        self.lock = threading.Lock()
        self.ports: list[int] = []
        self.numbers: Counter[str] = Counter()
        self.echo: Callable[[str], None] = (lambda line: None) if args.quiet or args.json else say

    def start(self, role: str) -> None:
        """Start one process of *role*."""
        self.numbers[role] += 1
        reader, writer = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=_TARGETS[role],
            args=(writer, self.config),
            name=f"oncely-demo-{role}-{self.numbers[role]}",
        )
        process.start()
        writer.close()  # so that the parent reads EOF once the child is gone
        self.slots.append(Slot(role, self.numbers[role], process, reader))

    def run(self) -> Tally:
        """Run until every request is answered and every event consumed; the tally."""
        deadline = time.monotonic() + RUN_TIMEOUT
        for role, count in (("api", self.args.api_workers), ("relay", 1)):
            for _ in range(count):
                self.start(role)
        for _ in range(self.args.consumers):
            self.start("consumer")
        clients = Clients(self)
        try:
            while not (clients.done() and self._drained()):
                if time.monotonic() > deadline:
                    self.echo(f"  the pipeline did not drain within {RUN_TIMEOUT:.0f}s")
                    break
                readers = {id(slot.reports): slot for slot in self.slots}
                for conn in wait([slot.reports for slot in self.slots], timeout=0.05):
                    self._receive(readers[id(conn)])
                clients.start_when_ready()
        finally:
            clients.stop()
            for slot in self.slots:
                slot.process.terminate()
            for slot in self.slots:
                slot.process.join(10)
                if slot.process.is_alive():
                    slot.process.kill()
                    slot.process.join()
                slot.reports.close()
        return self.tally

    def live_ports(self) -> list[int]:
        with self.lock:
            return list(self.ports)

    def _drained(self) -> bool:
        with contextlib.closing(sqlite3.connect(self.config.shop, timeout=60)) as shop:
            (pending,) = shop.execute(
                "SELECT COUNT(*) FROM oncely_outbox WHERE published_at_ms IS NULL"
            ).fetchone()
        if pending:
            return False
        with contextlib.closing(sqlite3.connect(self.config.broker, timeout=60)) as broker:
            unacked, delivered = broker.execute(
                "SELECT TOTAL(acked = 0), TOTAL(deliveries) FROM queue"
            ).fetchone()
        if unacked or self.args.unsafe:
            return not unacked
        # Every delivery received is reported too: a copy taken while its first delivery was
        # being acked elsewhere is still on its way to being deduplicated (and counted).
        return bool(delivered == self.args.orders + sum(self.tally.deduplicated.values()))

    def _receive(self, slot: Slot) -> None:
        try:
            while True:
                self._handle(slot, slot.reports.recv())
                if not slot.reports.poll():
                    return
        except EOFError:
            self._died(slot)

    def _handle(self, slot: Slot, message: dict[str, Any]) -> None:
        kind, tally = message["kind"], self.tally
        name = f"{slot.role}-{slot.number}"
        if kind == "ready":
            if slot.role == "api":
                slot.port = message["port"]
                with self.lock:
                    self.ports.append(slot.port)
        elif kind == "crash":
            tally.crashes[slot.role] += 1
            self.echo(f"  {name:<11} CRASH os._exit() {message['text']} ({message['label']})")
        elif kind == "deduplicated":
            tally.deduplicated[message["how"]] += 1
        elif kind == "shipped":
            tally.shipped += 1
        elif kind == "log":
            self.echo(f"  {name:<11} {message['text']}")
        elif kind != "published":  # pragma: no cover - a child broke the protocol
            raise DemoAborted(f"unknown message {message!r}")

    def _died(self, slot: Slot) -> None:
        slot.process.join()
        slot.reports.close()
        self.slots.remove(slot)
        with self.lock:
            if slot.port in self.ports:
                self.ports.remove(slot.port)
        if slot.process.exitcode != CRASH_EXIT_CODE:
            raise DemoAborted(
                f"{slot.role}-{slot.number} died with exit code {slot.process.exitcode}"
            )
        self.tally.restarts[slot.role] += 1
        self.start(slot.role)


class Clients:
    """Client threads: each order once (some twice), retried with its key until answered."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        args = pipeline.args
        rng = random.Random(args.seed)
        self.work = list(range(args.orders))
        rng.shuffle(self.work)
        self.doubles = {n for n in self.work if rng.random() < DOUBLE_SUBMIT}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def start_when_ready(self) -> None:
        if self.threads or not self.pipeline.live_ports():
            return
        for number in range(self.pipeline.args.clients):
            thread = threading.Thread(target=self._client, args=(number,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def done(self) -> bool:
        return bool(self.threads) and not any(thread.is_alive() for thread in self.threads)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def _take(self) -> int | None:
        with self.lock:
            return self.work.pop() if self.work else None

    def _client(self, number: int) -> None:
        rng = random.Random(f"{self.pipeline.args.seed}:client:{number}")
        while (order := self._take()) is not None:
            for _ in range(2 if order in self.doubles else 1):
                self._request(order, rng)

    def _request(self, order: int, rng: random.Random) -> None:
        tally = self.pipeline.tally
        key = order_key(order)
        body = json.dumps({"item": f"sku-{order % 17:02d}", "quantity": 1 + order % 3})
        attempts = 0
        backoff = 0.02
        while not self.stopping.is_set():
            ports = self.pipeline.live_ports()
            if not ports:  # every API worker is restarting
                time.sleep(0.05)
                continue
            attempts += 1
            try:
                status, document = _post(rng.choice(ports), key, body)
            except (OSError, http.client.HTTPException):
                time.sleep(backoff * rng.uniform(0.5, 1.0))  # no answer: retry, same key
                backoff = min(backoff * 2, 0.5)
                continue
            with self.pipeline.lock:
                tally.http_attempts += attempts
                tally.requests += 1
                if status == 201:
                    tally.created += 1
                elif status == 200:
                    tally.replayed += 1
                else:
                    tally.client_errors.append(f"{key}: {status} {document}")
                    return
                if key in tally.answers:
                    tally.double_submits += 1
                tally.answers.setdefault(key, set()).add(int(document["order_id"]))
            return


def _post(port: int, key: str, body: str) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(
            "POST",
            "/orders",
            body,
            {"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


# -- the check ----------------------------------------------------------------------------------


@dataclass
class Check:
    """The databases' view of the run, and the verdict."""

    orders: int
    events: int
    published_events: int
    broker_messages: int
    distinct_messages: int
    deliveries: int
    shipments: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        """Every request made one order, one event and one shipment; nothing lost."""
        return not self.problems


def check(config: Config, requested: int, tally: Tally) -> Check:
    """Count orders, events, messages and shipments per request key, from the databases."""

    def query(path: str, sql: str) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(path, timeout=60)) as connection:
            return connection.execute(sql).fetchall()

    orders = query(config.shop, "SELECT request_key, id FROM orders")
    events = [
        (json.loads(payload)["request_key"], published)
        for payload, published in query(
            config.shop, "SELECT payload, published_at_ms FROM oncely_outbox"
        )
    ]
    queued = query(config.broker, "SELECT message_id, deliveries FROM queue")
    shipments = query(config.warehouse, "SELECT request_key, order_id FROM shipments")
    keys = [order_key(n) for n in range(requested)]
    order_of: dict[str, list[int]] = {}
    for key, order_id in orders:
        order_of.setdefault(key, []).append(order_id)
    event_count = Counter(key for key, _ in events)
    shipped: dict[str, list[int]] = {}
    for key, order_id in shipments:
        shipped.setdefault(key, []).append(order_id)
    problems = []

    def problem(count: int, what: str) -> None:
        if count:
            problems.append(f"{count} {what}")

    problem(sum(1 for key in keys if key not in tally.answers), "requests never answered")
    problem(len(tally.client_errors), "requests answered with an error")
    problem(sum(1 for key in keys if key not in order_of), "requests without an order")
    problem(sum(len(ids) - 1 for ids in order_of.values() if len(ids) > 1), "duplicate orders")
    problem(
        sum(1 for key, ids in tally.answers.items() if ids != set(order_of.get(key, []))),
        "requests answered with another order than the one stored",
    )
    problem(sum(1 for key in keys if not event_count[key]), "orders without an event")
    problem(sum(n - 1 for n in event_count.values() if n > 1), "duplicate events")
    problem(sum(1 for _, published in events if published is None), "events never published")
    problem(sum(1 for key in keys if key not in shipped), "orders never shipped (lost)")
    problem(sum(len(ids) - 1 for ids in shipped.values() if len(ids) > 1), "duplicate shipments")
    problem(
        sum(1 for key, ids in shipped.items() if ids != order_of.get(key, [])),
        "shipments of another order than the one stored",
    )
    return Check(
        orders=len(orders),
        events=len(events),
        published_events=sum(1 for _, published in events if published is not None),
        broker_messages=len(queued),
        distinct_messages=len({mid for mid, _ in queued}),
        deliveries=sum(count for _, count in queued),
        shipments=len(shipments),
        problems=problems,
    )


# -- summary and command line -------------------------------------------------------------------


def summarise(
    args: argparse.Namespace, tally: Tally, result: Check, elapsed: float
) -> dict[str, Any]:
    """The machine-readable summary."""
    keys = [order_key(n) for n in range(args.orders)]
    # An order's first event: the only one with the inboxes, "#1" of several without.
    first_events = [message_id(key) + ("#1" if args.unsafe else "") for key in keys]
    planned = {
        "api": sum(crash_planned(args.seed, args.crash_rate, "api", key) for key in keys),
        "relay": sum(crash_planned(args.seed, args.crash_rate, "relay", e) for e in first_events),
        "consumer": sum(
            crash_planned(args.seed, args.crash_rate, "consumer", e) for e in first_events
        ),
    }
    return {
        "mode": "unsafe" if args.unsafe else "outbox",
        "orders_requested": args.orders,
        "requests": tally.requests,
        "double_submits": tally.double_submits,
        "http_attempts": tally.http_attempts,
        "retries": tally.http_attempts - tally.requests,
        "created_responses": tally.created,
        "replayed_responses": tally.replayed,
        "client_errors": tally.client_errors[:5],
        "api_workers": args.api_workers,
        "consumers": args.consumers,
        "clients": args.clients,
        "crash_rate": args.crash_rate,
        "seed": args.seed,
        "crashes": {point: tally.crashes[point] for point in POINTS},
        "crashes_planned": planned,
        "restarts": {point: tally.restarts[point] for point in POINTS},
        "orders": result.orders,
        "events": result.events,
        "events_published": result.published_events,
        "broker_messages": result.broker_messages,
        "republished": result.broker_messages - result.distinct_messages,
        "deliveries": result.deliveries,
        "redelivered": result.deliveries - result.broker_messages,
        "shipments": result.shipments,
        "deduplicated_republishes": tally.deduplicated["republish"],
        "deduplicated_redeliveries": tally.deduplicated["redelivery"],
        "problems": result.problems,
        "check_ok": result.ok,
        "check": describe(args.orders, result),
        "elapsed_s": round(elapsed, 3),
    }


def describe(orders: int, result: Check) -> str:
    """The verdict, one line."""
    if result.ok:
        return (
            f"end-to-end check: OK ({orders} order requests: each made exactly one order, one "
            "event, one shipment; nothing lost)"
        )
    return f"end-to-end check: FAILED ({'; '.join(result.problems)})"


def render_summary(summary: dict[str, Any]) -> str:
    """The table a person reads."""
    crashes, restarts = summary["crashes"], summary["restarts"]
    rows = [
        ("order requests", str(summary["orders_requested"]), "one Idempotency-Key each"),
        (
            "requests sent",
            str(summary["requests"]),
            f"{summary['double_submits']} sent twice on purpose",
        ),
        ("HTTP retries", str(summary["retries"]), "no answer: sent again with the same key"),
        ("replayed answers", str(summary["replayed_responses"]), "200 from the inbox record"),
        ("orders", str(summary["orders"]), "rows in shop.db"),
        ("events", str(summary["events"]), f"{summary['events_published']} published"),
        ("crashes: API", str(crashes["api"]), "after commit, before the response"),
        ("crashes: relay", str(crashes["relay"]), "after the broker confirmed, before marking"),
        ("crashes: consumer", str(crashes["consumer"]), "after the effect committed, before ack"),
        (
            "broker messages",
            str(summary["broker_messages"]),
            f"{summary['republished']} re-published",
        ),
        ("deliveries", str(summary["deliveries"]), f"{summary['redelivered']} redelivered"),
        (
            "deduplicated",
            str(summary["deduplicated_republishes"] + summary["deduplicated_redeliveries"]),
            f"{summary['deduplicated_republishes']} re-publishes, "
            f"{summary['deduplicated_redeliveries']} redeliveries (consumer inbox)",
        ),
        ("shipments", str(summary["shipments"]), "rows in warehouse.db"),
        ("restarts", str(sum(restarts.values())), "crashed processes replaced"),
        ("elapsed", f"{summary['elapsed_s']:.1f}s", ""),
    ]
    return render_table(rows)


def build_outbox_parser() -> argparse.ArgumentParser:
    """The outbox demo's options."""
    parser = argparse.ArgumentParser(
        prog="python -m oncely.demo --outbox",
        description=(
            "HTTP POST → inbox + order + outbox event in one SQLite transaction → relay → "
            "broker → consumer with its own inbox, with crashes at the three worst points; "
            "checks that each request made exactly one order and one shipment."
        ),
    )
    parser.add_argument("--orders", type=positive_int, default=60, help="default: 60")
    parser.add_argument(
        "--crash-rate",
        type=rate_below_one,
        default=0.1,
        help="share of orders (events) that crash the API (relay, consumer) (default: 0.1)",
    )
    parser.add_argument("--api-workers", type=positive_int, default=2, help="default: 2")
    parser.add_argument("--consumers", type=positive_int, default=2, help="default: 2")
    parser.add_argument(
        "--clients", type=positive_int, default=6, help="client threads (default 6)"
    )
    parser.add_argument("--seed", type=int, default=1, help="decides the order and the crashes")
    parser.add_argument("--dir", type=Path, help="where the SQLite files go (default: temporary)")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")
    parser.add_argument("--json", action="store_true", help="print a JSON summary only")
    parser.add_argument(
        "--unsafe", action="store_true", help="the same without the inboxes: watch the check fail"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m oncely.demo --outbox``: parse the options and run the demo."""
    return run_outbox_demo(build_outbox_parser().parse_args(argv))


def run_outbox_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when the check passes, 1 when it fails, 3 if aborted."""
    if args.dir is not None:
        directory = args.dir.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        return _run(args, directory, temporary=False)
    with tempfile.TemporaryDirectory(prefix="oncely-outbox-demo-") as temporary:
        return _run(args, Path(temporary), temporary=True)


def _run(args: argparse.Namespace, directory: Path, *, temporary: bool) -> int:
    config = Config(
        shop=str(directory / "shop.db"),
        broker=str(directory / "broker.db"),
        warehouse=str(directory / "warehouse.db"),
        seed=args.seed,
        crash_rate=args.crash_rate,
        unsafe=args.unsafe,
    )
    for path in (config.shop, config.broker, config.warehouse):
        if Path(path).exists():
            print(f"demo aborted: {path} exists; give an empty --dir", file=sys.stderr)
            return EXIT_ABORTED
    prepare(config)
    if not (args.quiet or args.json):
        where = "a temporary directory" if temporary else str(directory)
        say(
            "oncely demo --outbox: POST /orders → inbox + order + outbox (one transaction) → "
            "relay → broker → consumer inbox + shipment"
            f"{' WITHOUT the inboxes (--unsafe)' if args.unsafe else ''}\n"
            f"  {args.orders} orders | {args.clients} clients | {args.api_workers} API workers, "
            f"1 relay, {args.consumers} consumers | {args.crash_rate * 100:g}% crash at each "
            f"point (seed {args.seed})\n"
            f"  shop.db, broker.db, warehouse.db: SQLite files in {where}\n"
        )
    started = time.monotonic()
    try:
        tally = Pipeline(args, config).run()
    except DemoAborted as exc:
        print(f"demo aborted: {exc}", file=sys.stderr)
        return EXIT_ABORTED
    elapsed = time.monotonic() - started
    result = check(config, args.orders, tally)
    summary = summarise(args, tally, result, elapsed)
    summary.update(directory=str(directory), temporary=temporary)
    if args.json:
        say(json.dumps(summary, indent=2))
    else:
        if not args.quiet:
            say("")
        say(render_summary(summary))
        say("")
        say(summary["check"])
    return EXIT_OK if result.ok else EXIT_CHECK_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
