"""The effect under test: one row per handler execution in a PostgreSQL table of the test's own."""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from oncely.consumers import ConsumerPolicy

FAST = ConsumerPolicy(
    lease=timedelta(seconds=1.5),
    ttl=timedelta(minutes=5),
    max_attempts=3,
    retry_delay=timedelta(milliseconds=100),
)
"""Short leases, so recovery after a kill takes a second or two; a short ttl, so the test's
records leave the shared Redis soon even if a teardown is skipped."""


def env(name: str) -> str:
    """A server URL from the environment (set by scripts/services --env)."""
    return os.environ[name]


class Ledger:
    """A table ``<table>(key, worker)`` with no uniqueness: a double effect is two rows."""

    def __init__(self, url: str, *, table: str) -> None:
        self.url = url
        self.table = table
        self._name = sql.Identifier(table)

    def create(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} (id bigserial PRIMARY KEY, key text, worker text)").format(
                    self._name
                )
            )

    def drop(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._name))

    def insert_statement(self) -> sql.Composed:
        return sql.SQL("INSERT INTO {} (key, worker) VALUES (%s, %s)").format(self._name)

    def write(self, key: str, worker: str = "") -> None:
        """Record one effect (its own transaction)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(self.insert_statement(), (key, worker))

    async def awrite(self, key: str, worker: str = "") -> None:
        """Async `write`."""
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            await conn.execute(self.insert_statement(), (key, worker))

    def counts(self) -> Counter[str]:
        """Rows per key."""
        with psycopg.connect(self.url) as conn:
            rows = conn.execute(sql.SQL("SELECT key FROM {}").format(self._name)).fetchall()
        return Counter(row[0] for row in rows)

    def rows(self) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url) as conn:
            return conn.execute(
                sql.SQL("SELECT key, worker FROM {} ORDER BY id").format(self._name)
            ).fetchall()

    def wait_for(self, expected: int, *, timeout: float = 30.0) -> Counter[str]:
        """Poll (bounded) until *expected* rows exist in all; return the counts."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.counts()
            if sum(counts.values()) >= expected:
                return counts
            if time.monotonic() > deadline:
                raise AssertionError(f"{expected} effects expected, found {dict(counts)}")
            time.sleep(0.05)


class Worker:
    """A consumer subprocess (`tests.consumers._worker`) to be killed with SIGKILL."""

    def __init__(self, broker: str, config: dict[str, Any]) -> None:
        import json
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        root = Path(__file__).resolve().parents[2]
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in kill()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.consumers._worker", broker, json.dumps(config)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Block (bounded) until the worker's handler holds the message; return its key."""
        import selectors
        import time

        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while True:  # skip whatever else the worker prints (banners)
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise AssertionError(f"the worker was not ready in {timeout}s: {self.errors()}")
                line = self.process.stdout.readline()
                if line.startswith("READY "):
                    return line.split(" ", 1)[1].strip()
                if not line:
                    raise AssertionError(f"the worker exited: {self.errors()}")

    def errors(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-3000:]

    def kill(self) -> None:
        """SIGKILL the worker and reap it."""
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()
