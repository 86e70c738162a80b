"""A publisher for the relay's tests: it "publishes" by appending lines to a file.

Not a stand-in for a broker (the broker publishers have their own tests against real brokers):
it is the relay's other side, recording what it was handed, in order, and failing on request.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

from oncely.outbox import NOT_ATTEMPTED, OutboxEvent, Outcome


class Poisoned(Exception):
    """What the publisher answers for an event it was told to fail."""


class FilePublisher:
    """Appends one JSON line per published event to *path*.

    Attributes:
        down: Raise for the whole call (the broker is unreachable).
        poison: Destinations whose events always fail.
        fail_times: message id → how many more times that event fails.
        hang_after: Once a batch is recorded, touch this file and hang (to be SIGKILLed).
        delay: Seconds each call takes before it records (a broker's round trip).
        hang: Message ids whose call never returns (a broker that never answers for them).
        keep_going: Publish a key's later events after one failed (as a pipelined publisher
            may find them confirmed), rather than answering them `NOT_ATTEMPTED`.
    """

    def __init__(self, path: str | os.PathLike[str], *, hang_after: str | None = None) -> None:
        self.path = Path(path)
        self.down = False
        self.poison: set[str] = set()
        self.fail_times: dict[str, int] = {}
        self.hang_after = hang_after
        self.delay = 0.0
        self.hang: set[str] = set()
        self.keep_going = False
        self.tag = ""
        self.calls = 0

    async def publish(self, events: Sequence[OutboxEvent]) -> list[Outcome]:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.down:
            raise ConnectionError("broker unreachable")
        if any(event.message_id in self.hang for event in events):
            await asyncio.sleep(3600)
        outcomes: list[Outcome] = []
        failed_keys: set[tuple[str, str]] = set()
        lines = []
        for event in events:
            scope = (event.destination, event.ordering_key or "")
            if event.ordering_key is not None and scope in failed_keys:
                outcomes.append(NOT_ATTEMPTED)
                continue
            left = self.fail_times.get(event.message_id, 0)
            if event.destination in self.poison or left:
                self.fail_times[event.message_id] = max(left - 1, 0)
                outcomes.append(Poisoned(f"cannot publish {event.message_id}"))
                if event.ordering_key is not None and not self.keep_going:
                    failed_keys.add(scope)
                continue
            lines.append(
                json.dumps(
                    {
                        "id": event.id,
                        "message_id": event.message_id,
                        "destination": event.destination,
                        "key": event.ordering_key,
                        "payload": event.payload.decode(),
                        "headers": dict(event.headers),
                        "attempts": event.attempts,
                        "pid": os.getpid(),
                        "tag": self.tag,
                    }
                )
            )
            outcomes.append(None)
        with self.path.open("a") as file:
            file.write("".join(line + "\n" for line in lines))
            file.flush()
            os.fsync(file.fileno())
        if self.hang_after and lines:
            _touch(self.hang_after)
            await asyncio.sleep(3600)
        return outcomes

    async def aclose(self) -> None:
        pass

    def published(self) -> list[dict[str, object]]:
        return read(self.path)


def _touch(path: str) -> None:
    Path(path).touch()


def read(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The events published to *path*, in order."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line]


def from_env(url: str | None = None) -> FilePublisher:
    """For ``oncely relay --publisher tests.outbox._publisher:from_env`` and subprocesses."""
    return FilePublisher(
        url or os.environ["ONCELY_TEST_OUTBOX_FILE"], hang_after=os.environ.get("ONCELY_TEST_HANG")
    )
