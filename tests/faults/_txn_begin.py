"""Histories of a transactional handler whose ``begin()`` opens no transaction.

The ``txn_nobegin`` entry is the ``txn`` one (`oncely.Inbox.transactional` under
`oncely.idempotent`, the effect written through `oncely.current_transaction`) with a ``begin``
that returns a PostgreSQL connection in autocommit: every write it makes commits on its own.
Such a setup must be refused before the handler runs, every time, so the effect is applied at
most once per key (here: never) however often clients retry. The checker's usual promise holds
(no double effect, no failure whose write stands); only ``unfinished`` is expected: a key whose
every answer was the `oncely.errors.ConfigurationError` is the setup's fault, by design.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from tests.faults._checker import Anomaly
from tests.faults._checker import check as check_history
from tests.faults._history import History

ENTRY = "txn_nobegin"

RETRY_FOR = 1.0
"""Seconds the retrying client keeps at a key: about ten attempts, each a chance to write."""


def applicable(store: str, fault: str) -> bool:
    """One history: the effect's database is PostgreSQL, and the fault is the setup itself."""
    return store == "postgres" and fault == "none"


def function(worker: Any, hold: float) -> Any:
    """The entry's operation for *worker* (a `tests.faults._workers.Worker`): ``txn``'s, but
    ``begin`` opens an autocommit connection."""
    import psycopg

    import oncely

    url = worker.config["txn_url"]

    @oncely.Inbox(worker.store).transactional(lambda: psycopg.connect(url, autocommit=True))
    def write(key: str, op: str, token: int) -> dict[str, Any]:
        worker.point("claim", op, key)
        time.sleep(hold)
        worker.effects.write(oncely.current_transaction(), key, op, token)  # commits at once
        return {"op": op, "token": token}

    def run(key: str, op: str) -> dict[str, Any]:
        lease = oncely.current_lease()
        assert lease is not None
        token = lease.token
        worker.event("run", op, key, token=token)
        try:
            value = write(key, op, token)
            worker.event("effect", op, key, token=token, accepted=True)
            return value
        finally:
            worker.event("end", op, key)

    return worker.protected(run)


def check(history: History, rows: Iterable[Mapping[str, Any]]) -> list[Anomaly]:
    """The usual check, less ``unfinished`` for keys every client was refused with a
    `ConfigurationError` (the answer a setup without a transaction gets)."""
    refused = {
        event["key"] for event in history.of("fail") if event.get("error") == "ConfigurationError"
    }
    answered = {
        event["key"]
        for event in (*history.of("ok"), *history.of("fail"))
        if event.get("error") != "ConfigurationError"
    }
    return [
        anomaly
        for anomaly in check_history(history, rows)
        if not (anomaly.kind == "unfinished" and anomaly.key in refused - answered)
    ]
