"""The storm demo's worker process: it runs the guarded payments function for the jobs the parent
sends, crashing on purpose where the plan says (`CrashGate`), and reports over a pipe."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import oncely
from oncely._demos._common import PipeLogHandler
from oncely._demos._storm_plan import (
    CRASH_EXIT_CODE,
    FIRST_BACKOFF,
    LEASE_SECONDS,
    SCOPE,
    Job,
    Message,
    Receipt,
    WorkerConfig,
    amount_cents,
    crashes,
    open_bank,
    payment_id,
)
from oncely.errors import InProgressError, LeaseLostError

# -- worker process -----------------------------------------------------------------------------


class CrashGate:
    """Lets an injected crash interrupt only its own call.

    Every protected call runs inside `call`. `crash` stops new calls from starting, waits for the
    calls in flight to return (and report), then hard-exits the process.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._busy = 0
        self._closing = False

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Run one call; blocks for good once the process is about to crash."""
        with self._condition:
            while self._closing:
                self._condition.wait()
            self._busy += 1
        try:
            yield
        finally:
            with self._condition:
                self._busy -= 1
                self._condition.notify_all()

    def crash(self) -> NoReturn:
        """Hard-exit once every other call has returned: no cleanup, the lease stays held."""
        with self._condition:
            self._busy -= 1
            self._condition.notify_all()
            if self._closing:  # another thread is already taking the process down
                while True:
                    self._condition.wait()
            self._closing = True
            while self._busy > 0:
                self._condition.wait()
        os._exit(CRASH_EXIT_CODE)


class Worker:
    """One worker process: a store, a crash gate, a pipe to the parent, several client threads."""

    def __init__(
        self, jobs: Connection[Any, Any], reports: Connection[Any, Any], config: WorkerConfig
    ) -> None:
        self.jobs = jobs
        self.reports = reports
        self.config = config
        self.pid = os.getpid()
        self.gate = CrashGate()
        self._send_lock = threading.Lock()
        self.store: oncely.Store | None = None
        if config.safe:
            self.store = oncely.open_store(config.store_url, namespace=config.namespace)

    def send(self, kind: str, **fields: Any) -> None:
        """Report to the parent; returns once the message is in the pipe."""
        message = Message(kind, self.config.worker, self.pid, **fields)
        with self._send_lock:
            self.reports.send(message)

    def serve(self) -> None:
        """Hand jobs from the parent to the client threads until told to stop."""
        jobs: deque[Job | None] = deque()
        ready = threading.Condition()

        def take() -> Job | None:
            with ready:
                while not jobs:
                    ready.wait()
                return jobs.popleft()

        clients = [Client(self, take) for _ in range(self.config.threads)]
        threads = [
            threading.Thread(target=client.run, name=f"client-{n}", daemon=True)
            for n, client in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        while True:
            try:
                job: Job | None = self.jobs.recv()
            except EOFError:  # the parent went away
                job = None
            with ready:
                if job is None:
                    jobs.extend([None] * len(threads))
                else:
                    jobs.append(job)
                ready.notify_all()
            if job is None:
                break
        for thread in threads:
            thread.join()
        if self.store is not None:
            self.store.close()


class Client:
    """One client thread: calls ``charge`` for each job, retrying while it is in progress."""

    def __init__(self, worker: Worker, take: Callable[[], Job | None]) -> None:
        self.worker = worker
        self.take = take
        self.bank: sqlite3.Connection | None = None  # opened by the client's own thread
        self.job: Job | None = None
        self.executed = False  # whether the current call ran the body (or was replayed)
        self.charge: Callable[[str, int], Receipt] = self._charge
        if worker.store is not None:
            # The whole integration: one decorator. A duplicate of a running charge raises
            # InProgressError; a finished one replays its Receipt.
            self.charge = oncely.idempotent(
                store=worker.store,
                key="payment_id",
                scope=SCOPE,
                lease=LEASE_SECONDS,
                ttl=3600,
                on_conflict="raise",
            )(self._charge)

    def run(self) -> None:
        """Serve jobs until the worker stops."""
        self.bank = open_bank(self.worker.config.bank_path)
        try:
            while (job := self.take()) is not None:
                self.call(job)
        finally:
            self.bank.close()

    def call(self, job: Job) -> None:
        """One client call of the storm, with the client-side retry loop."""
        rng = random.Random(f"{self.worker.config.seed}:{job.id}:{job.delivery}")
        backoff = FIRST_BACKOFF
        key = payment_id(job.payment)
        while True:
            with self.worker.gate.call():
                self.job, self.executed = job, False
                try:
                    receipt = self.charge(key, amount_cents(job.payment))
                except InProgressError as exc:
                    self.worker.send("conflict", job=job.id, payment=job.payment)
                    delay = min(exc.retry_after.total_seconds(), backoff)
                except LeaseLostError as exc:
                    self.worker.send("lease_lost", job=job.id, payment=job.payment, text=str(exc))
                    return
                except Exception as exc:
                    text = f"{type(exc).__name__}: {exc}"
                    self.worker.send("error", job=job.id, payment=job.payment, text=text)
                    return
                else:
                    kind = "charged" if self.executed else "replayed"
                    self.worker.send(
                        kind, job=job.id, payment=job.payment, token=receipt.fencing_token
                    )
                    return
            time.sleep(delay * rng.uniform(0.5, 1.0))  # client backoff, never synchronisation
            backoff *= 2

    def _charge(self, payment_id: str, amount_cents: int) -> Receipt:
        """The payments function: charge *amount_cents* for *payment_id* at the bank."""
        job = self.job
        assert job is not None
        config = self.worker.config
        self.executed = True
        if self.worker.store is not None:
            # The lease we hold: its fencing token, and which execution of this payment this
            # is (1, or more after crashes: crashes are planned per both).
            lease = oncely.current_lease()
            assert lease is not None, f"{payment_id} runs without a lease"
            token, execution, label = lease.token, lease.attempt, payment_id
        else:
            token, execution, label = 0, job.delivery, f"{payment_id}/{job.attempt}"
        if crashes(config.seed, config.crash_rate, label, execution):
            self.worker.send("crash", job=job.id, payment=job.payment, token=token)
            self.worker.gate.crash()
        assert self.bank is not None
        cursor = self.bank.execute(
            "INSERT INTO ledger (run, payment_id, amount_cents, fencing_token, pid) "
            "VALUES (?, ?, ?, ?, ?)",
            (config.run, payment_id, amount_cents, token, self.worker.pid),
        )
        return Receipt(payment_id, amount_cents, cursor.lastrowid or 0, token)


def worker_main(
    jobs: Connection[Any, Any], reports: Connection[Any, Any], config: WorkerConfig
) -> None:
    """Entry point of a worker process: jobs come in on one pipe, reports go out on another."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    worker = Worker(jobs, reports, config)
    logger = logging.getLogger("oncely")
    logger.addHandler(PipeLogHandler(worker))
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        worker.serve()
    finally:
        jobs.close()
        reports.close()
