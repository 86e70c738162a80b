"""The oncely demo: a retry storm against a payments function, and a ledger that proves it.

``python -m oncely.demo`` fires every one of N payments many times, concurrently, from several
worker processes each running several threads: the at-least-once world of client retries and
broker redeliveries. The payments function is guarded by ``@oncely.idempotent`` on a SQLite
store (WAL, shared by every process) and "charges" by appending a row, with its fencing token,
to a ledger in a separate SQLite file: the bank, the ground truth.

Some executions crash on purpose: right after claiming the payment, before charging it, the
worker process calls ``os._exit()``. Its lease stays held and nothing is charged; the parent
starts a replacement worker and redelivers the lost calls, and once the short lease expires the
next claim recovers it and charges. Duplicates that find the payment running get
`InProgressError` and retry (waiting at most its ``retry_after``); later ones replay the stored
receipt. At the end the ledger is checked: every payment charged exactly once, by the lease that
completed it (its fencing token is in the ledger row). The summary counts are exact: workers
report over pipes that survive their crash, and recovered leases are read from the store's
records. ``--unsafe`` runs the same storm without oncely, to show the check failing.

The crashes are deterministic per ``--seed`` (a hash of the payment and its execution number
decides), so every run crashes the same calls whatever the interleaving. An injected crash waits
for the other calls in flight in its process to return first: it interrupts only itself, between
claim and charge. (A crash between charging and completing is the gap that only a transactional
inbox closes, by committing the charge and the record together.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sqlite3
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import oncely
from oncely._core.keys import scope_key
from oncely._demos._common import DemoAborted, positive_int, rate_below_one, render_table, say
from oncely._demos._storm_plan import (
    _LEDGER_SCHEMA,
    CRASH_EXIT_CODE,
    EXIT_ABORTED,
    EXIT_LEDGER_FAILED,
    EXIT_OK,
    LEASE_SECONDS,
    RUN_TIMEOUT,
    SCOPE,
    Job,
    Message,
    WorkerConfig,
    open_bank,
    payment_id,
    planned_crashes,
    schedule,
)
from oncely._demos._storm_worker import worker_main

__all__ = ["main"]

# -- parent: dispatch, restart, count -----------------------------------------------------------


@dataclass
class Slot:
    """A running worker process as the parent sees it."""

    config: WorkerConfig
    process: multiprocessing.process.BaseProcess
    jobs: Connection[Any, Any]
    reports: Connection[Any, Any]
    inflight: dict[int, Job] = field(default_factory=dict)


@dataclass
class Tally:
    """What the workers reported."""

    charged: int = 0
    replayed: int = 0
    conflicts: int = 0
    crashes: int = 0
    restarts: int = 0
    redelivered: int = 0
    lease_lost: int = 0
    errors: int = 0
    recovered_logged: int = 0


class Storm:
    """Runs the storm: keeps every worker busy, restarts crashed ones, redelivers lost calls."""

    def __init__(self, args: argparse.Namespace, store_url: str, bank_path: str, run: str) -> None:
        self.args = args
        self.store_url = store_url
        self.bank_path = bank_path
        self.run = run
        self.context = multiprocessing.get_context("spawn")
        self.pending: deque[Job] = deque(schedule(args.payments, args.attempts, args.seed))
        self.slots: list[Slot] = []
        self.tally = Tally()
        self._next_worker = 0
        self.echo: Callable[[str], None] = (lambda line: None) if args.quiet or args.json else say

    def start_worker(self) -> None:
        """Start one worker process."""
        self._next_worker += 1
        config = WorkerConfig(
            worker=self._next_worker,
            threads=self.args.threads,
            store_url=self.store_url,
            namespace=self.run,
            bank_path=self.bank_path,
            run=self.run,
            seed=self.args.seed,
            crash_rate=self.args.crash_rate,
            safe=not self.args.unsafe,
        )
        # Two one-way OS pipes: a dead worker's reports stay readable, then read as EOF.
        job_reader, job_writer = self.context.Pipe(duplex=False)
        report_reader, report_writer = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=worker_main,
            args=(job_reader, report_writer, config),
            name=f"oncely-demo-worker-{config.worker}",
        )
        process.start()
        job_reader.close()
        report_writer.close()  # so that the parent sees EOF when the worker dies
        self.slots.append(Slot(config, process, job_writer, report_reader))

    def run_to_end(self) -> Tally:
        """Dispatch every job and return the tally; raises `DemoAborted` on trouble."""
        deadline = time.monotonic() + RUN_TIMEOUT
        try:
            for _ in range(self.args.processes):
                self.start_worker()
            while self.pending or any(slot.inflight for slot in self.slots):
                self._dispatch()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DemoAborted(f"the storm did not drain within {RUN_TIMEOUT:.0f}s")
                by_conn = {id(slot.reports): slot for slot in self.slots}
                for conn in wait([slot.reports for slot in self.slots], timeout=remaining):
                    self._receive(by_conn[id(conn)])
            for slot in self.slots:
                slot.jobs.send(None)
            for slot in self.slots:
                slot.process.join(timeout=30)
                if slot.process.exitcode != 0:
                    raise DemoAborted(
                        f"worker {slot.config.worker} exited with {slot.process.exitcode}"
                    )
        finally:
            for slot in self.slots:
                if slot.process.is_alive():
                    slot.process.terminate()
                    slot.process.join()
                slot.jobs.close()
                slot.reports.close()
        return self.tally

    def _dispatch(self) -> None:
        for slot in self.slots:
            while self.pending and len(slot.inflight) < self.args.threads:
                job = self.pending.popleft()
                slot.inflight[job.id] = job
                try:
                    slot.jobs.send(job)
                except OSError:  # the worker died; its EOF redelivers the job
                    break

    def _receive(self, slot: Slot) -> None:
        try:
            while True:
                self._handle(slot, slot.reports.recv())
                if not slot.reports.poll():
                    return
        except EOFError:
            self._died(slot)

    def _handle(self, slot: Slot, message: Message) -> None:
        tally = self.tally
        name = payment_id(message.payment)
        if message.kind == "log":
            if "lease recovered" in message.text:
                tally.recovered_logged += 1
            self.echo(f"  worker {message.worker:<3} {message.text}")
        elif message.kind == "conflict":
            tally.conflicts += 1
        elif message.kind == "crash":
            tally.crashes += 1
            held = "" if self.args.unsafe else f" holding its lease (token {message.token})"
            self.echo(
                f"  worker {message.worker:<3} CRASH os._exit() in charge({name!r}){held}, "
                "before charging"
            )
        elif message.kind in ("charged", "replayed"):
            del slot.inflight[message.job]
            if message.kind == "charged":
                tally.charged += 1
            else:
                tally.replayed += 1
        elif message.kind == "lease_lost":
            del slot.inflight[message.job]
            tally.lease_lost += 1
            self.echo(f"  worker {message.worker:<3} LEASE LOST {message.text}")
        elif message.kind == "error":
            del slot.inflight[message.job]
            tally.errors += 1
            self.echo(f"  worker {message.worker:<3} ERROR {name}: {message.text}")
        else:  # pragma: no cover - a worker broke the protocol
            raise DemoAborted(f"unknown message {message!r}")

    def _died(self, slot: Slot) -> None:
        slot.process.join()
        slot.jobs.close()
        slot.reports.close()
        self.slots.remove(slot)
        if slot.process.exitcode != CRASH_EXIT_CODE:
            raise DemoAborted(
                f"worker {slot.config.worker} died with exit code {slot.process.exitcode}"
            )
        lost = sorted(slot.inflight.values(), key=lambda job: job.id)
        self.tally.redelivered += len(lost)
        self.tally.restarts += 1
        self.pending.extendleft(
            Job(job.id, job.payment, job.attempt, job.delivery + 1) for job in reversed(lost)
        )
        self.start_worker()


# -- the check and the summary ------------------------------------------------------------------


@dataclass
class LedgerCheck:
    """The bank's view: how many charges each payment got, and whether that is right."""

    rows: int
    missing: list[str]
    duplicated: dict[str, int]
    stale_tokens: list[str]
    recovered: int | None

    @property
    def ok(self) -> bool:
        """Every payment charged exactly once, by the lease that completed it."""
        return not (self.missing or self.duplicated or self.stale_tokens)

    def describe(self, payments: int) -> str:
        """One line: OK, or FAILED with what is wrong."""
        if self.ok:
            return (
                f"ledger check: OK ({payments} payments, {self.rows} charges: each payment "
                "charged exactly once)"
            )
        problems = []
        if self.duplicated:
            extra = sum(count - 1 for count in self.duplicated.values())
            problems.append(f"{extra} duplicate charges on {len(self.duplicated)} payments")
        if self.missing:
            problems.append(f"{len(self.missing)} payments never charged")
        if self.stale_tokens:
            problems.append(f"{len(self.stale_tokens)} charges under a stale fencing token")
        return f"ledger check: FAILED ({', '.join(problems)})"


def check_ledger(
    bank_path: str, run: str, payments: int, store: oncely.Store | None
) -> LedgerCheck:
    """Compare the ledger with the payments (and, with oncely, with the store's records)."""
    bank = sqlite3.connect(bank_path)
    try:
        rows = bank.execute(
            "SELECT payment_id, COUNT(*), MAX(fencing_token) FROM ledger WHERE run = ? "
            "GROUP BY payment_id",
            (run,),
        ).fetchall()
    finally:
        bank.close()
    charged = {name: (count, token) for name, count, token in rows}
    names = [payment_id(payment) for payment in range(payments)]
    check = LedgerCheck(
        rows=sum(count for count, _ in charged.values()),
        missing=[name for name in names if name not in charged],
        duplicated={name: count for name, (count, _) in charged.items() if count > 1},
        stale_tokens=[],
        recovered=None,
    )
    if store is not None:
        check.recovered = 0
        for name in names:
            record = store.get(scope_key(SCOPE, name))
            if record is None:
                continue
            # No call raises in the demo, so every execution after the first took over an
            # expired lease: attempt - 1 recoveries.
            check.recovered += record.attempt - 1
            if name in charged and charged[name][1] != record.token:
                check.stale_tokens.append(name)
    return check


def summarise(
    args: argparse.Namespace, tally: Tally, check: LedgerCheck, elapsed: float
) -> dict[str, Any]:
    """The machine-readable summary."""
    attempts = args.payments * args.attempts
    labels = (
        [payment_id(p) for p in range(args.payments)]
        if not args.unsafe
        else [f"{payment_id(p)}/{a}" for p in range(args.payments) for a in range(args.attempts)]
    )
    return {
        "mode": "unsafe" if args.unsafe else "oncely",
        "payments": args.payments,
        "attempts": attempts,
        "processes": args.processes,
        "threads": args.threads,
        "crash_rate": args.crash_rate,
        "seed": args.seed,
        "lease_s": LEASE_SECONDS,
        "charges": check.rows,
        "executions_returned": tally.charged,
        "replays": tally.replayed,
        "conflicts": tally.conflicts,
        "crashes": tally.crashes,
        "crashes_planned": planned_crashes(args.seed, args.crash_rate, labels),
        "worker_restarts": tally.restarts,
        "redelivered": tally.redelivered,
        "recovered": check.recovered,
        "recovered_logged": tally.recovered_logged,
        "lease_lost": tally.lease_lost,
        "errors": tally.errors,
        "missing": len(check.missing),
        "duplicates": sum(count - 1 for count in check.duplicated.values()),
        "stale_tokens": len(check.stale_tokens),
        "ledger_ok": check.ok,
        "ledger_check": check.describe(args.payments),
        "elapsed_s": round(elapsed, 3),
    }


def render_summary(summary: dict[str, Any]) -> str:
    """The table a person reads."""
    recovered = summary["recovered"]
    rows = [
        (
            "attempts",
            str(summary["attempts"]),
            f"client calls: {summary['payments']} payments x "
            f"{summary['attempts'] // summary['payments']}, fired concurrently",
        ),
        ("unique payments", str(summary["payments"]), ""),
        ("charges executed", str(summary["charges"]), "rows in the bank's ledger"),
        ("replays", str(summary["replays"]), "stored receipt returned, nothing charged"),
        ("conflicts", str(summary["conflicts"]), "InProgressError; retried within retry_after"),
        (
            "crashes",
            str(summary["crashes"]),
            f"os._exit() between claim and charge ({summary['worker_restarts']} worker restarts)",
        ),
        (
            "recovered leases",
            "-" if recovered is None else str(recovered),
            "expired leases taken over (store records: attempt > 1)",
        ),
    ]
    if summary["lease_lost"]:
        rows.append(("leases lost", str(summary["lease_lost"]), "LeaseLostError at complete"))
    if summary["errors"]:
        rows.append(("errors", str(summary["errors"]), "unexpected exceptions"))
    rows.append(("elapsed", f"{summary['elapsed_s']:.1f}s", ""))
    return render_table(rows)


# -- command line -------------------------------------------------------------------------------


def build_parser(prog: str = "python -m oncely.demo") -> argparse.ArgumentParser:
    """The demo's options (*prog* names the command in its usage line)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "A retry storm against a payments function guarded by oncely on SQLite, with "
            "crashing workers; checks that the bank's ledger charged every payment exactly once."
        ),
    )
    parser.add_argument("--payments", type=positive_int, default=200, help="default: 200")
    parser.add_argument(
        "--attempts", type=positive_int, default=8, help="calls per payment (default: 8)"
    )
    parser.add_argument(
        "--processes", type=positive_int, default=4, help="worker processes (default: 4)"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=4, help="threads per process (default: 4)"
    )
    parser.add_argument(
        "--crash-rate",
        type=rate_below_one,
        default=0.05,
        help="share of executions that hard-crash after claiming (default: 0.05)",
    )
    parser.add_argument("--seed", type=int, default=1, help="decides the order and crashes")
    parser.add_argument(
        "--db",
        type=Path,
        help="the store's SQLite file; the ledger goes next to it (default: a temporary dir)",
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="serve the payments API with uvicorn and storm it with HTTP clients over sockets "
        "(--threads is then the number of clients)",
    )
    parser.add_argument(
        "--drop-rate",
        type=rate_below_one,
        default=0.25,
        help="--http: share of responses the proxy drops (default: 0.25)",
    )
    parser.add_argument(
        "--outbox",
        action="store_true",
        help="the end-to-end demo instead: HTTP, inbox and outbox in one transaction, relay, "
        "broker, consumer, with crashes (its own options: --outbox --help)",
    )
    parser.add_argument("--quiet", action="store_true", help="print the summary only")
    parser.add_argument("--json", action="store_true", help="print a JSON summary only")
    parser.add_argument("--unsafe", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None, *, prog: str = "python -m oncely.demo") -> int:
    """Run the demo; return 0 when the ledger check passes, 1 when it fails, 3 if aborted."""
    argv = sys.argv[1:] if argv is None else argv
    if "--outbox" in argv:  # a demo of its own, with its own options
        from oncely._demos.outbox import main as outbox_main

        return outbox_main([arg for arg in argv if arg != "--outbox"])
    args = build_parser(prog).parse_args(argv)
    if args.http:
        from oncely._demos.api import run_http_demo

        return run_http_demo(args)
    if args.db is not None:
        db_path = args.db.resolve()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        return _run(args, db_path, temporary=False)
    with tempfile.TemporaryDirectory(prefix="oncely-demo-") as directory:
        return _run(args, Path(directory) / "oncely.db", temporary=True)


def _header(args: argparse.Namespace, where: str) -> str:
    guard = "WITHOUT oncely (--unsafe)" if args.unsafe else "guarded by @oncely.idempotent"
    return (
        f"oncely demo: a retry storm on charge(payment_id, amount_cents), {guard}\n"
        f"  {args.payments} payments x {args.attempts} attempts | {args.processes} processes x "
        f"{args.threads} threads | lease {LEASE_SECONDS:g}s | {args.crash_rate * 100:g}% of "
        f"executions crash (seed {args.seed})\n"
        f"  oncely store and bank ledger: SQLite files in {where}\n"
    )


def _run(args: argparse.Namespace, db_path: Path, *, temporary: bool) -> int:
    run = f"demo-{uuid.uuid4().hex[:8]}"  # keeps this run's keys and ledger rows apart
    store_url = f"sqlite:///{db_path}"
    bank_path = str(db_path.with_name(f"{db_path.stem}.bank{db_path.suffix or '.db'}"))
    with contextlib.closing(open_bank(bank_path)) as bank:
        bank.executescript(_LEDGER_SCHEMA)
    with contextlib.ExitStack() as stack:
        store = None
        if not args.unsafe:  # opened here first, so the schema exists before workers start
            store = oncely.open_store(store_url, namespace=run)
            stack.callback(store.close)
        if not (args.quiet or args.json):
            say(_header(args, "a temporary directory" if temporary else str(db_path.parent)))
        started = time.monotonic()
        try:
            tally = Storm(args, store_url, bank_path, run).run_to_end()
        except DemoAborted as exc:
            print(f"demo aborted: {exc}", file=sys.stderr)
            return EXIT_ABORTED
        elapsed = time.monotonic() - started
        check = check_ledger(bank_path, run, args.payments, store)
    summary = summarise(args, tally, check, elapsed)
    summary.update(run=run, store=str(db_path), bank=bank_path, temporary=temporary)
    if args.json:
        say(json.dumps(summary, indent=2))
    else:
        if not args.quiet:
            say("")
        say(render_summary(summary))
        say("")
        say(summary["ledger_check"])
    return EXIT_OK if check.ok else EXIT_LEDGER_FAILED
