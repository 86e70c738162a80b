"""What the relay tests share: fast settings, and running a relay until it is done."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from oncely.outbox import Outbox, Relay
from tests.outbox._publisher import FilePublisher
from tests.outbox.conftest import Db

FAST: dict[str, Any] = {"poll_interval": 0.05, "backoff": 0.01, "max_backoff": 0.05}


def relay_for(db: Db, publisher: FilePublisher, **options: Any) -> Relay:
    return Relay(db.store(), publisher, **{**FAST, **options})


async def drain(relay: Relay) -> int:
    """Run cycles until one publishes nothing; return how many were published."""
    total = 0
    while published := await relay.run_once():
        total += published
    return total


async def until(check: Callable[[], object], timeout: float = 20.0) -> None:
    """Wait (in the loop, letting the relay run) until *check* is true, or fail."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.01)


def close(relay: Relay) -> None:
    asyncio.run(relay.aclose())
    relay.store.close()


def add_events(db: Db, outbox: Outbox, events: list[tuple[str, str | None]]) -> list[str]:
    """Add (destination, ordering key) events, one transaction each; return their ids."""
    ids = []
    connection = db.connect()
    try:
        for destination, key in events:
            with db.transaction(connection):
                ids.append(outbox.add(connection, destination, destination, ordering_key=key))
    finally:
        connection.close()
    return ids
