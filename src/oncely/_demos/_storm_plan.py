"""The storm demo's plan and shared parts: its constants, which calls crash (decided up front
from the seed), the messages workers send the parent, and the bank's ledger. `oncely._demos.storm`
runs it; `oncely._demos._storm_worker` is the worker process."""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass

from oncely._demos._common import fraction

SCOPE = "payments.charge"
"""The decorator's scope: stored keys are ``payments.charge|pay-0042``."""

LEASE_SECONDS = 1.0
"""A short lease, so that crashed calls are recovered within the demo's few seconds."""

CRASH_EXIT_CODE = 86
"""The exit status of a worker that crashed on purpose (anything else aborts the demo)."""

MAX_CRASHES_PER_CALL = 3
"""A payment (or, with ``--unsafe``, a call) crashes at most this many times in a row."""

FIRST_BACKOFF = 0.02
"""The client's first wait after `InProgressError`; it doubles, capped by ``retry_after``."""

RUN_TIMEOUT = 300.0
"""Give up (and say so) if the storm has not drained after this many seconds."""

EXIT_OK, EXIT_LEDGER_FAILED, EXIT_ABORTED = 0, 1, 3


# -- plan: what happens, decided up front -------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One client call: *attempt* of *payment*, delivered for the *delivery*-th time."""

    id: int
    payment: int
    attempt: int
    delivery: int = 1


def payment_id(payment: int) -> str:
    """The idempotency key of payment number *payment*."""
    return f"pay-{payment:04d}"


def amount_cents(payment: int) -> int:
    """A deterministic amount for payment number *payment*."""
    return 1_000 + (payment * 7_919) % 9_000


def crashes(seed: int, rate: float, label: str, execution: int) -> bool:
    """Whether execution number *execution* of the call named *label* crashes."""
    return execution <= MAX_CRASHES_PER_CALL and fraction(seed, f"{label}#{execution}") < rate


def planned_crashes(seed: int, rate: float, labels: list[str]) -> int:
    """How many crashes the plan holds: each label crashes until its first clean execution."""
    total = 0
    for label in labels:
        execution = 1
        while crashes(seed, rate, label, execution):
            total += 1
            execution += 1
    return total


def schedule(payments: int, attempts: int, seed: int) -> list[Job]:
    """Every attempt of every payment, in a seeded order that keeps a payment's retries close.

    A retry storm: each payment's attempts are spread over a window of a few payments, so
    duplicates overlap the first call (conflicts) or follow it (replays).
    """
    rng = random.Random(seed)
    window = 3.0
    arrivals = sorted(
        (payment + rng.random() * window, payment, attempt)
        for payment in range(payments)
        for attempt in range(attempts)
    )
    return [Job(index, payment, attempt) for index, (_, payment, attempt) in enumerate(arrivals)]


# -- messages from workers to the parent ---------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """What a worker reports; sent synchronously over a pipe, so it survives ``os._exit()``.

    *kind* is one of ``charged``, ``replayed``, ``conflict``, ``crash``, ``lease_lost``,
    ``error`` (about job *job*) or ``log`` (a line of the ``oncely`` logger, in *text*).
    """

    kind: str
    worker: int
    pid: int
    job: int = -1
    payment: int = -1
    token: int = 0
    text: str = ""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs (pickled to it by the spawn start method)."""

    worker: int
    threads: int
    store_url: str
    namespace: str
    bank_path: str
    run: str
    seed: int
    crash_rate: float
    safe: bool


# -- the bank -----------------------------------------------------------------------------------

_LEDGER_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY,
    run TEXT NOT NULL,
    payment_id TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    fencing_token INTEGER NOT NULL,
    pid INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_run_payment ON ledger (run, payment_id)
"""


def open_bank(path: str) -> sqlite3.Connection:
    """Open the bank's ledger database (autocommit; WAL so that workers write concurrently)."""
    connection = sqlite3.connect(path, timeout=60.0, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    return connection


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a charge returns; oncely stores it and replays it to duplicates."""

    payment_id: str
    amount_cents: int
    ledger_row: int
    fencing_token: int
