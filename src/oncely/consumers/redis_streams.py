"""Redis Streams consumers (redis-py consumer groups): each entry takes effect once.

.. code-block:: python

    from oncely.consumers.redis_streams import RedisStreamConsumer

    def on_order(entry: StreamEntry) -> None:
        charge(json.loads(entry.fields[b"body"]))

    consumer = RedisStreamConsumer(redis.Redis(), "orders", "billing", on_order, store=store)
    consumer.create_group()
    consumer.run(stop_event)          # or: await consumer.arun() with redis.asyncio and async def

How the runner's verdicts reach the stream (docs/guides/consumers.md):

* ack: one ``XACK`` per poll for the entries whose records are completed (or that are
  completed duplicates). Each poll's entries go through the runner as one batch
  (`IdempotentConsumer.batch_flow`): with a store that has the batch verbs, one claim call per
  poll, each entry completed as its handler returns (completions grouped into batch calls),
  and the handlers run concurrently with an async client;
* retry: nothing: the entry stays in the group's pending list and ``XAUTOCLAIM`` hands it
  out again once it has been idle for *claim_idle* (Redis has no nack; by default the lease,
  whatever the verdict's delay). The same reclaiming picks up the entries of a consumer that
  died mid-handler, and runs them once the dead worker's lease has ended;
* dead-letter: ``MULTI; XADD <dead-letter stream> …; XACK; EXEC``: the copy is added and the
  original acknowledged in one transaction, so a crash in between loses nothing.

An entry's body is its ``body`` field when it has one, else the canonical JSON of its fields
(key fields left out), and its key is the ``Idempotency-Key`` (or ``x-idempotency-key``) field,
else the entry id, which ``XAUTOCLAIM`` keeps. Use `oncely.consumers.producer.redis_fields` to
stamp keys on entries.

`poll` and `run` take a `redis.Redis` and a sync handler; `apoll` and `arun` a
`redis.asyncio.Redis` and an async one. Both run the same flow; only the drivers differ.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from oncely._core.codec import Codec
from oncely._core.fingerprint import canonical_json
from oncely._core.flow import Flow
from oncely._core.policy import Duration, to_timedelta
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._deps import require
from oncely._log import get_logger
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._drivers import BrokerOp, arun_with, run_with
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    ConsumerStats,
    Delivery,
    FingerprintSource,
    KeySource,
    Verdict,
)
from oncely.errors import ConfigurationError

require("redis", extra="redis")

__all__ = ["DEAD_LETTER_FIELDS", "RedisStreamConsumer", "StreamEntry"]

logger = get_logger(__name__)

DEAD_LETTER_FIELDS = ("oncely-dead-letter-reason", "oncely-source-stream", "oncely-source-id")
"""Fields added to a dead-lettered copy: why, and where it came from."""


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One stream entry, as the handler receives it.

    Attributes:
        stream: The stream's name.
        id: The entry id (``"1700000000000-0"``).
        fields: The entry's fields, as the client returned them (bytes unless the client
            decodes responses).

    .. versionadded:: 0.1.0
    """

    stream: str
    id: str
    fields: Mapping[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Call(BrokerOp):
    """Call the client's *method*."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Transaction(BrokerOp):
    """Run *calls* in one ``MULTI``/``EXEC``."""

    calls: Sequence[_Call]


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


class RedisStreamConsumer:
    """Read a stream as one member of a consumer group, running *handler* once per key.

    Args:
        client: A `redis.Redis` (for `poll` and `run`) or a `redis.asyncio.Redis` (for
            `apoll` and `arun`).
        stream: The stream to read.
        group: The consumer group; also the default scope of the keys.
        handler: Called with each `StreamEntry` that must take effect (async for `apoll`).
        store: Where the records are kept.
        consumer: This member's name in the group (default: host, pid and a random suffix).
        scope: The scope of the keys (default: ``<stream>:<group>``).
        policy: Leases, retention and attempts (`oncely.consumers.ConsumerPolicy`).
        key: Where the key comes from (see `oncely.consumers.KeySource`).
        key_headers: The fields tried for ``key="header"``.
        fingerprint: What defines the operation (default: the canonical body).
        codec: Serialises what the handler returns, for the record.
        dead_letter_stream: Where dead-lettered copies go (default ``<stream>:dead``).
        batch_size: Entries read (and reclaimed) per poll.
        block: How long a poll waits for new entries.
        claim_idle: How long an entry stays pending before any member reclaims it: the
            redelivery delay of a retry, and how soon a dead member's entries are picked up.
            Default: the policy's lease, since a dead member's message cannot run again sooner,
            and a live member's batch is not taken from it while its leases are fresh.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        client: Any,
        stream: str,
        group: str,
        handler: Callable[[StreamEntry], Any],
        *,
        store: SyncStore | AsyncStore,
        consumer: str | None = None,
        scope: str | None = None,
        policy: ConsumerPolicy | None = None,
        key: KeySource = "header",
        key_headers: tuple[str, ...] = KEY_HEADERS,
        fingerprint: FingerprintSource = "body",
        codec: Codec | None = None,
        dead_letter_stream: str | None = None,
        batch_size: int = 16,
        block: Duration = timedelta(seconds=1),
        claim_idle: Duration | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be 1 or more, not {batch_size}")
        self.client = client
        self.stream = stream
        self.group = group
        self.handler = handler
        self.name = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.consumer = IdempotentConsumer(
            store,
            scope=scope or f"{stream}:{group}",
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
        )
        self.dead_letter_stream = dead_letter_stream or f"{stream}:dead"
        if self.dead_letter_stream == stream:
            raise ConfigurationError("the dead-letter stream must not be the stream itself")
        self.batch_size = batch_size
        self.block = to_timedelta(block, "block")
        self.claim_idle = to_timedelta(
            claim_idle if claim_idle is not None else self.consumer.policy.lease,
            "claim_idle",
        )
        self._cursor = "0-0"

    @property
    def stats(self) -> ConsumerStats:
        """Counters of verdicts (processed, duplicate, in_progress...)."""
        return self.consumer.stats

    # -- the flows, once ---------------------------------------------------------------------

    def _group_flow(self) -> Flow[bool]:
        try:
            yield _Call("xgroup_create", (self.stream, self.group), {"id": "0", "mkstream": True})
        except Exception as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
        return True

    def _poll_flow(self) -> Flow[int]:
        reply = yield _Call(
            "xautoclaim",
            (self.stream, self.group, self.name, int(self.claim_idle / timedelta(milliseconds=1))),
            {"start_id": self._cursor, "count": self.batch_size},
        )
        self._cursor = _text(reply[0])
        entries = [(entry_id, fields) for entry_id, fields in reply[1] if fields is not None]
        if len(entries) < self.batch_size:
            block = None if entries else int(self.block / timedelta(milliseconds=1))
            read = yield _Call(
                "xreadgroup",
                (self.group, self.name, {self.stream: ">"}),
                {"count": self.batch_size - len(entries), "block": block},
            )
            streams = read.items() if isinstance(read, Mapping) else (read or ())  # RESP3 / 2
            for _, stream_entries in streams:
                entries.extend(stream_entries)
        batch = [StreamEntry(self.stream, _text(entry_id), fields) for entry_id, fields in entries]
        if batch:
            verdicts = yield from self.consumer.batch_flow([self._delivery(e) for e in batch])
            yield from self._settle_flow(batch, verdicts)
        return len(batch)

    def _settle_flow(self, batch: list[StreamEntry], verdicts: list[Verdict]) -> Flow[None]:
        done = [e.id for e, v in zip(batch, verdicts, strict=True) if v.action is Action.ACK]
        if done:
            yield _Call("xack", (self.stream, self.group, *done))
        dead = [
            (e, v) for e, v in zip(batch, verdicts, strict=True) if v.action is Action.DEAD_LETTER
        ]
        if dead:  # the copies and the acks in one transaction: a crash loses nothing
            reason, source, source_id = DEAD_LETTER_FIELDS
            calls = [
                _Call(
                    "xadd",
                    (
                        self.dead_letter_stream,
                        {**e.fields, reason: str(v.reason), source: self.stream, source_id: e.id},
                    ),
                )
                for e, v in dead
            ]
            calls.append(_Call("xack", (self.stream, self.group, *(e.id for e, _ in dead))))
            yield _Transaction(calls)
        # RETRY: left pending, for XAUTOCLAIM to hand out again after claim_idle.

    def _run_flow(self, stopped: Callable[[], bool]) -> Flow[None]:
        while not stopped():
            yield from self._poll_flow()

    def _delivery(self, entry: StreamEntry) -> Delivery:
        fields = {_text(name): value for name, value in entry.fields.items()}
        lowered = {name.lower() for name in self.consumer.key_headers}
        if "body" in fields:
            body = fields["body"]
            body = body if isinstance(body, bytes) else str(body).encode()
        else:
            rest = {name: value for name, value in fields.items() if name.lower() not in lowered}
            body = canonical_json(rest).encode()
        return Delivery(body, fields, entry.id, raw=entry)

    # -- sync ----------------------------------------------------------------------------------

    def _perform(self, op: BrokerOp) -> Any:
        if isinstance(op, _Transaction):
            with self.client.pipeline(transaction=True) as pipe:
                for call in op.calls:
                    getattr(pipe, call.method)(*call.args, **call.kwargs)
                return pipe.execute()
        assert isinstance(op, _Call)
        return getattr(self.client, op.method)(*op.args, **op.kwargs)

    def _sync(self, flow: Flow[Any]) -> Any:
        store: SyncStore = self.consumer._required(SyncStore)
        return run_with(flow, store, self.handler, self._perform)

    def create_group(self) -> bool:
        """Create the consumer group (and the stream) if missing; return whether it was created."""
        return bool(self._sync(self._group_flow()))

    def poll(self) -> int:
        """Reclaim idle entries, read new ones (waiting up to *block*), process them.

        Returns:
            How many entries were handed to the runner.
        """
        return int(self._sync(self._poll_flow()))

    def run(self, stop: threading.Event) -> None:
        """Poll until *stop* is set."""
        self._sync(self._run_flow(stop.is_set))

    # -- async ---------------------------------------------------------------------------------

    async def _aperform(self, op: BrokerOp) -> Any:
        if isinstance(op, _Transaction):
            async with self.client.pipeline(transaction=True) as pipe:
                for call in op.calls:
                    getattr(pipe, call.method)(*call.args, **call.kwargs)
                return await pipe.execute()
        assert isinstance(op, _Call)
        return await getattr(self.client, op.method)(*op.args, **op.kwargs)

    async def _async(self, flow: Flow[Any]) -> Any:
        store: AsyncStore = self.consumer._required(AsyncStore)
        return await arun_with(flow, store, self.handler, self._aperform)

    async def acreate_group(self) -> bool:
        """Async `create_group`."""
        return bool(await self._async(self._group_flow()))

    async def apoll(self) -> int:
        """Async `poll`."""
        return int(await self._async(self._poll_flow()))

    async def arun(self, stop: asyncio.Event | None = None) -> None:
        """Poll until *stop* is set (or the task is cancelled)."""
        stopped = stop.is_set if stop is not None else (lambda: False)
        await self._async(self._run_flow(stopped))
