"""Benchmark the transactional inbox on PostgreSQL against the same transaction without oncely.

    python benchmarks/inbox/bench_inbox.py                 # about a minute
    python benchmarks/inbox/bench_inbox.py --ops 300 --rounds 5 --workers 1 8

Each operation is one transaction that inserts an order row and commits:

- ``plain``: ``BEGIN; INSERT INTO orders …; COMMIT`` with psycopg, no oncely;
- ``inbox``: the same transaction, with the order's key claimed by `oncely.Inbox` before the
  insert and its result recorded after it (the record commits with the order);
- ``dedupe``: the plain transaction with the dedupe every team writes by hand first: ``INSERT
  INTO processed (id) VALUES (…) ON CONFLICT DO NOTHING``, the order inserted only if that
  inserted a row. The target: ``inbox`` and ``inbox-owned`` at least 0.9 of it;
- ``inbox-owned``: the same transaction opened by the inbox itself (`Inbox.transaction`): BEGIN
  and the claim in one round trip, the result's UPDATE and the COMMIT in one more;
- ``inbox-pipeline``: ``inbox`` with the caller's transaction in psycopg's pipeline mode, where
  the result's UPDATE goes with the commit;
- ``inbox-none`` (for reference): ``inbox`` recording no result (the claim alone);
- ``replay`` (for reference): a transaction that claims a key committed earlier and gets its
  stored result back, writing nothing.

Each worker is a thread with a connection of its own (one worker, and several concurrent ones).
Subjects run interleaved, in rounds whose order rotates, so drift in the load of a shared machine
falls on all of them; each figure is the median over the rounds, and each ratio the median of
the per-round ratios (``inbox`` to ``dedupe``, and each to ``plain``). The report goes to stdout
and to ``benchmarks/results/inbox.md``. Not a test: pytest never collects this directory. Its
tables live in a schema of the run's own, dropped at the end.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shlex
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

import oncely

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "stores"))
from bench_stores import machine  # noqa: E402  (the same description of the machine)

RESULTS = ROOT / "benchmarks" / "results" / "inbox.md"
TARGET = 0.9
SUBJECTS = ("plain", "dedupe", "inbox", "inbox-owned", "inbox-pipeline", "inbox-none", "replay")
TARGETED = ("inbox", "inbox-owned")
"""The subjects held to the target, each against ``dedupe``."""


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "ONCELY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--ops", type=int, default=200, help="transactions per worker per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


class Bench:
    """A schema of the run's own, with the orders table and oncely's records."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.schema = f"oncely_bench_inbox_{uuid.uuid4().hex[:8]}"
        join = "&" if "?" in base else "?"
        self.store = oncely.open_store(f"{base}{join}schema={self.schema}")
        self.store.migrate()  # type: ignore[attr-defined]
        self.inbox = oncely.Inbox(self.store)
        with self.connect() as connection:
            connection.execute("CREATE TABLE orders (id text PRIMARY KEY, cents integer)")
            connection.execute("CREATE TABLE processed (id text PRIMARY KEY)")
            connection.commit()
        self.replayable: list[str] = []

    def connect(self) -> psycopg.Connection[Any]:
        connection = psycopg.connect(self.base)
        connection.execute(f'SET search_path TO "{self.schema}"')
        connection.commit()
        return connection

    def close(self) -> None:
        self.store.close()
        with psycopg.connect(self.base, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    def operation(self, subject: str) -> Callable[[psycopg.Connection[Any], str], None]:
        inbox = self.inbox

        def plain(connection: psycopg.Connection[Any], key: str) -> None:
            with connection.transaction():
                connection.execute("INSERT INTO orders VALUES (%s, %s)", (key, 1250))

        def with_inbox(connection: psycopg.Connection[Any], key: str) -> None:
            with connection.transaction(), inbox.claim(connection, key, scope="orders") as entry:
                connection.execute("INSERT INTO orders VALUES (%s, %s)", (key, 1250))
                entry.complete({"order": key, "cents": 1250})

        def inbox_owned(connection: psycopg.Connection[Any], key: str) -> None:
            with inbox.transaction(connection, key, scope="orders") as entry:
                connection.execute("INSERT INTO orders VALUES (%s, %s)", (key, 1250))
                entry.complete({"order": key, "cents": 1250})

        def inbox_pipeline(connection: psycopg.Connection[Any], key: str) -> None:
            with (
                connection.pipeline(),
                connection.transaction(),
                inbox.claim(connection, key, scope="orders") as entry,
            ):
                connection.execute("INSERT INTO orders VALUES (%s, %s)", (key, 1250))
                entry.complete({"order": key, "cents": 1250})

        def inbox_none(connection: psycopg.Connection[Any], key: str) -> None:
            with connection.transaction(), inbox.claim(connection, key, scope="orders"):
                connection.execute("INSERT INTO orders VALUES (%s, %s)", (key, 1250))

        def replay(connection: psycopg.Connection[Any], key: str) -> None:
            with connection.transaction(), inbox.claim(connection, key, scope="orders") as entry:
                assert entry.replayed

        def dedupe(connection: psycopg.Connection[Any], key: str) -> None:
            with connection.transaction():
                seen = connection.execute(
                    "INSERT INTO processed (id) VALUES (%s) ON CONFLICT DO NOTHING", (key,)
                )
                if seen.rowcount == 1:
                    connection.execute("INSERT INTO orders VALUES (%s, %s)", (key, 1250))

        subjects = {
            "plain": plain,
            "dedupe": dedupe,
            "inbox": with_inbox,
            "inbox-owned": inbox_owned,
        }
        subjects |= {"inbox-pipeline": inbox_pipeline, "inbox-none": inbox_none}
        return {**subjects, "replay": replay}[subject]


CPU: dict[str, list[tuple[float, float, int]]] = {}
"""Per subject, per one-worker round: the client's and the server's CPU seconds, transactions
(summed over the rounds: the server's clock ticks are coarse)."""


def backend_cpu(connection: Any) -> float | None:
    """CPU seconds the server process of *connection* has used (a local server only)."""
    try:
        with open(f"/proc/{connection.info.backend_pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_round(
    bench: Bench, subject: str, workers: int, ops: int, connections: list[Any], tag: str
) -> float:
    """Transactions per second of *workers* threads doing *ops* each (and, with one worker,
    the client's and the server's CPU time per transaction, into `CPU`)."""
    operation = bench.operation(subject)
    if subject == "replay":
        keys = [
            [bench.replayable[(w * ops + i) % len(bench.replayable)] for i in range(ops)]
            for w in range(workers)
        ]
    else:
        keys = [[f"{tag}-{subject}-{w}-{i}" for i in range(ops)] for w in range(workers)]
    barrier = threading.Barrier(workers + 1)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        connection = connections[index]
        barrier.wait()
        try:
            for key in keys[index]:
                operation(connection, key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(workers)]
    for thread in threads:
        thread.start()
    server = backend_cpu(connections[0]) if workers == 1 else None
    barrier.wait()
    started, client = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    if server is not None and not tag.startswith("warm"):
        client = time.process_time() - client
        server = (backend_cpu(connections[0]) or server) - server
        CPU.setdefault(subject, []).append((client, server, ops))
    if subject == "inbox" and len(bench.replayable) < workers * ops:
        bench.replayable.extend(key for chunk in keys for key in chunk)
    return workers * ops / elapsed


def run(bench: Bench, workers: int, ops: int, rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {subject: [] for subject in SUBJECTS}
    connections = [bench.connect() for _ in range(workers)]
    try:
        for subject in ("plain", "inbox"):  # warm-up: connections, caches, the replay keys
            timed_round(bench, subject, workers, max(ops // 4, 10), connections, f"warm{workers}")
        for number in range(rounds):
            shift = number % len(SUBJECTS)
            order = SUBJECTS[shift:] + SUBJECTS[:shift]
            for subject in order:
                rate = timed_round(
                    bench, subject, workers, ops, connections, f"x{workers}r{number}"
                )
                samples[subject].append(rate)
            print(
                f"  x{workers} round {number + 1}: "
                + ", ".join(f"{s} {samples[s][-1]:.0f}/s" for s in SUBJECTS),
                file=sys.stderr,
            )
    finally:
        for connection in connections:
            connection.close()
    return samples


def render(results: dict[int, dict[str, list[float]]], context: dict[str, Any]) -> str:
    lines = [
        "# Transactional inbox: PostgreSQL, against the same transaction without oncely",
        "",
        f"Generated by `{context['command']}` on {context['started']} ({context['machine']}; "
        f"{context['versions']}). Load average at the start: {context['load_start']}; at the "
        f"end: {context['load_end']}. {context['rounds']} interleaved rounds of "
        f"{context['ops']} transactions per worker per subject, order rotating; medians.",
        "",
        "Each transaction inserts one order row and commits. `dedupe` first inserts the key "
        "into a table of processed ids (`INSERT … ON CONFLICT DO NOTHING`, by hand): what "
        "every team writes. `inbox` claims the key with `oncely.Inbox` instead (one round "
        "trip: a savepoint and one INSERT of the record, already complete, in one query) and "
        "records the block's result after the insert (one UPDATE); `inbox-owned` lets the "
        "inbox open the transaction (`Inbox.transaction`: BEGIN and the claim in one round "
        "trip, the result's UPDATE and the COMMIT in one more); `inbox-pipeline` is "
        "`inbox` with the transaction in psycopg's pipeline mode, where that UPDATE goes with "
        "the commit; `inbox-none` records no result (the claim alone). `replay` claims a key "
        "committed earlier and reads its result back, writing nothing.",
        "",
        "## Throughput",
        "",
        f"| workers | {' | '.join(SUBJECTS)} "
        + "".join(f"| {subject} / dedupe (target ≥ {TARGET}) " for subject in TARGETED)
        + "| inbox-none / dedupe | dedupe / plain | inbox / plain |",
        "|" + "---|" * (len(SUBJECTS) + 4 + len(TARGETED)),
    ]
    for workers, samples in results.items():

        def ratio(a: str, b: str, samples: dict[str, list[float]] = samples) -> float:
            return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

        cells = [f"{statistics.median(samples[s]):,.0f} tx/s" for s in SUBJECTS]
        for subject in TARGETED:
            target = ratio(subject, "dedupe")
            cells.append(f"{target:.2f} ({'met' if target >= TARGET else '**not met**'})")
        lines.append(
            f"| {workers} | {' | '.join(cells)} "
            f"| {ratio('inbox-none', 'dedupe'):.2f} | {ratio('dedupe', 'plain'):.2f} "
            f"| {ratio('inbox', 'plain'):.2f} |"
        )
    if CPU:
        lines += [
            "",
            "## CPU per transaction",
            "",
            "One worker: the client process's CPU time and its server process's (from /proc), "
            "per transaction, over all the rounds. Unlike throughput, these hardly move with "
            "the load of a shared machine.",
            "",
            "| subject | client | server | total | total / dedupe's |",
            "|---|---|---|---|---|",
        ]
        per = {
            subject: (
                sum(c for c, _, _ in rounds) / sum(n for _, _, n in rounds) * 1e6,
                sum(v for _, v, _ in rounds) / sum(n for _, _, n in rounds) * 1e6,
            )
            for subject, rounds in CPU.items()
        }
        for subject in SUBJECTS:
            if subject in per:
                client, server = per[subject]
                share = (client + server) / sum(per["dedupe"])
                lines.append(
                    f"| {subject} | {client:,.0f} µs | {server:,.0f} µs "
                    f"| {client + server:,.0f} µs | {share:.2f} |"
                )
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    bench = Bench(args.postgres_url)
    try:
        with psycopg.connect(args.postgres_url) as connection:
            server = connection.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        results = {w: run(bench, w, args.ops, args.rounds) for w in args.workers}
    finally:
        bench.close()
    versions = [f"PostgreSQL {server}"] + [
        f"{name} {importlib.metadata.version(name)}" for name in ("psycopg", "oncely")
    ]
    report = render(
        results,
        {
            "command": shlex.join(["python", "benchmarks/inbox/bench_inbox.py", *argv]),
            "started": started,
            "machine": "; ".join(machine()),
            "versions": ", ".join(versions),
            "load_start": load_start,
            "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "rounds": args.rounds,
            "ops": args.ops,
        },
    )
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
