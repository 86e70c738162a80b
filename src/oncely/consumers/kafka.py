"""Kafka consumers: each record takes effect once; offsets never move past unfinished work.

Two clients, one set of flows: `IdempotentKafkaConsumer` runs a sync handler on
confluent-kafka, `AsyncIdempotentKafkaConsumer` an async one on aiokafka.

.. code-block:: python

    from oncely.consumers.kafka import IdempotentKafkaConsumer

    def on_order(message: confluent_kafka.Message) -> None:
        charge(json.loads(message.value()))

    consumer = IdempotentKafkaConsumer(
        {"bootstrap.servers": "localhost:9092", "group.id": "billing"},
        ["orders"], on_order, store=store,
    )
    consumer.run(stop_event)

Kafka has no acknowledgement per message, only a committed offset per partition: the offset
never moves past a record that is not settled, a record to retry rewinds and pauses its
partition, and a dead letter is produced (and confirmed) before its offset is committed. How
rounds, rewinds, held leases, copies across partitions and rebalances work is told in
docs/guides/consumers.md ("Kafka").

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias

from oncely._core.codec import Codec
from oncely._core.flow import Flow
from oncely._core.policy import Duration, to_timedelta
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._deps import require
from oncely._log import fields, get_logger
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._drivers import BrokerOp, Parallel, arun_with, run_with
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    ConsumerStats,
    Delivery,
    FingerprintSource,
    KeySource,
    Reason,
    Verdict,
    seconds,
)
from oncely.errors import ConfigurationError, OncelyError

if TYPE_CHECKING:
    import confluent_kafka

__all__ = [
    "AsyncIdempotentKafkaConsumer",
    "DEAD_LETTER_HEADERS",
    "DeadLetterError",
    "IdempotentKafkaConsumer",
]

logger = get_logger(__name__)

_FIRST_BACKOFF = 0.01
"""Seconds before a record is first run again in place; doubled up to the verdict's delay."""

_BUSY = frozenset({Reason.IN_PROGRESS, Reason.BLOCKED, Reason.LEASE_LOST})
"""Retries that wait for another copy of the key rather than for the handler's troubles."""

Partition: TypeAlias = tuple[str, int]
"""A topic and a partition number."""

DEAD_LETTER_HEADERS = (
    "oncely-dead-letter-reason",
    "oncely-source-topic",
    "oncely-source-partition",
    "oncely-source-offset",
)
"""Headers added to a dead-lettered record: why, and where it came from."""


class DeadLetterError(OncelyError):
    """A record could not be produced to the dead-letter topic (it is retried, not skipped)."""


@dataclass(frozen=True, slots=True)
class _Assigned(BrokerOp):
    """Is *partition* still assigned to this member (and the consumer not stopping)?"""

    partition: Partition


@dataclass(frozen=True, slots=True)
class _Commit(BrokerOp):
    """Commit *offset* (the next record to read) for *partition*, synchronously."""

    partition: Partition
    offset: int


@dataclass(frozen=True, slots=True)
class _Rewind(BrokerOp):
    """Fetch *partition* again from *offset*, not before *delay* seconds (it is paused)."""

    partition: Partition
    offset: int
    delay: float


@dataclass(frozen=True, slots=True)
class _DeadLetter(BrokerOp):
    """Produce *record* to *topic* with *headers*, and wait for the broker's confirmation."""

    topic: str
    record: Any
    headers: list[tuple[str, str | bytes | None]]


@dataclass(slots=True, eq=False)
class _PartitionState:
    """What this member keeps for one partition of its assignment between polls."""

    held: dict[str, Any] = field(default_factory=dict)
    """Leases of records blocked behind one to retry, kept for the next round."""
    backoff: float = _FIRST_BACKOFF
    """The wait before its next rewind while the key it waits for is busy elsewhere."""
    next: int | None = None
    """The offset it must be fetched from (the first record not settled), if one is."""
    settled: frozenset[int] = frozenset()
    """Offsets past `next` that are settled already (not run again when fetched again)."""
    paused_until: float | None = None
    """When its pause ends (``time.monotonic``), while it is paused."""

    def round_done(self) -> None:
        """Every record fetched was settled: nothing waits but the held leases."""
        self.backoff, self.next, self.settled = _FIRST_BACKOFF, None, frozenset()


class _KafkaFlows:
    """What both clients share: the flows, the runner, the partitions this member owns."""

    def __init__(
        self,
        handler: Callable[[Any], Any],
        store: SyncStore | AsyncStore,
        *,
        group: str,
        scope: str | None,
        policy: ConsumerPolicy | None,
        key: KeySource,
        key_headers: tuple[str, ...],
        fingerprint: FingerprintSource,
        codec: Codec | None,
        dead_letter_topic: str | Callable[[str], str] | None,
        batch_size: int,
        poll_timeout: Duration,
    ) -> None:
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be 1 or more, not {batch_size}")
        self.handler = handler
        self.consumer = IdempotentConsumer(
            store,
            scope=scope or f"kafka:{group}",
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
        )
        if dead_letter_topic is None:
            self._dead_letter_topic: Callable[[str], str] = lambda topic: f"{topic}.dead"
        elif isinstance(dead_letter_topic, str):
            self._dead_letter_topic = lambda topic: dead_letter_topic
        else:
            self._dead_letter_topic = dead_letter_topic
        self.batch_size = batch_size
        self.poll_timeout = to_timedelta(poll_timeout, "poll_timeout")
        self._assigned: set[Partition] = set()
        self._stopping = False
        self._stop: threading.Event | asyncio.Event | None = None
        self._partitions: dict[Partition, _PartitionState] = {}

    @property
    def stats(self) -> ConsumerStats:
        """Counters of verdicts (processed, duplicate, in_progress...)."""
        return self.consumer.stats

    @property
    def assignment(self) -> frozenset[Partition]:
        """The (topic, partition) pairs assigned to this member now."""
        return frozenset(self._assigned)

    # -- what differs between the clients' records -------------------------------------------

    def _coordinates(self, record: Any) -> tuple[str, int, int]:
        raise NotImplementedError

    def _fields(self, record: Any) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Return the record's value, key and headers."""
        raise NotImplementedError

    def _delivery(self, record: Any) -> Delivery:
        topic, partition, offset = self._coordinates(record)
        value, _, headers = self._fields(record)
        return Delivery(value or b"", dict(headers), f"{topic}/{partition}/{offset}", raw=record)

    # -- the flows, once -----------------------------------------------------------------------

    def _batch_flow(self, batch: Mapping[Partition, Sequence[Any]]) -> Flow[int]:
        yield Parallel([self._partition_flow(part, records) for part, records in batch.items()])
        return sum(len(records) for records in batch.values())

    def _partition_flow(self, partition: Partition, records: Sequence[Any]) -> Flow[None]:
        """One round of a partition's records: settle them in order, commit the settled prefix,
        and have the rest fetched again after a delay.

        A round runs each record at most once, so a poll never lasts much longer than its
        handlers: the member keeps polling (within ``max.poll.interval.ms``) and sees its stop
        and its rebalances between rounds, whatever the store or the handler does.
        """
        state = self._partitions.setdefault(partition, _PartitionState())
        first = self._coordinates(records[0])[2]
        expected = first if state.next is None else state.next
        if first > expected or not (yield _Assigned(partition)):
            # Records past one still unsettled (a rewind that did not happen), or a partition
            # revoked or stopping: fetched again from the first unsettled one, or by its owner.
            yield _Rewind(partition, expected, 0.0)
            return
        offsets = [self._coordinates(record)[2] for record in records]
        known = state.settled  # settled past the one to retry
        settled = [offset in known for offset in offsets]
        todo = [i for i in range(len(records)) if not settled[i]]
        held = _Held(self._partitions, partition)
        verdicts = yield from self.consumer.batch_flow(
            [self._delivery(records[i]) for i in todo], ordered=True, held=held
        )
        if held.orphaned():
            # Revoked while the batch ran (past revoke_timeout): nothing will come back for the
            # leases just kept for the next round. Give them back for the new owner.
            orphans = held.release()
            logger.warning(
                "partition %s was revoked while its batch ran: releasing %d kept leases",
                partition,
                len(orphans),
            )
            yield from self.consumer.release_flow(orphans)
        blocker: Verdict | None = None  # the first record to run again decides the wait
        for i, verdict in zip(todo, verdicts, strict=True):
            if verdict.action is Action.DEAD_LETTER:
                try:
                    yield self._dead_letter(records[i], verdict)
                except Exception as exc:
                    # The decision is in the record: the next round dead-letters it again,
                    # without running the handler.
                    logger.error(
                        "could not dead-letter key=%s; retrying: %s",
                        verdict.key,
                        exc,
                        extra=fields(key=verdict.key, outcome="dead_letter_failed"),
                    )
                    continue
            elif verdict.action is Action.RETRY:
                blocker = blocker or verdict
                continue
            settled[i] = True
        done = 0  # records[:done] are settled
        while done < len(records) and settled[done]:
            done += 1
        backoff = state.backoff
        if done:  # never past a record that is not settled
            yield _Commit(partition, offsets[done - 1] + 1)
            backoff = _FIRST_BACKOFF
        if done == len(records):
            state.round_done()
            return
        # Kafka cannot redeliver one record: the unsettled ones are fetched again after a delay.
        # A key busy elsewhere is mostly a copy in another partition, done in milliseconds: poll
        # it with a growing backoff, up to the verdict's delay.
        wait = self.consumer.policy.retry_delay
        if blocker is not None and blocker.delay is not None:
            wait = blocker.delay
        limit = seconds(wait)
        busy = blocker is None or blocker.reason in _BUSY
        state.next = offsets[done]
        state.settled = frozenset(
            [offset for offset in known if offset > offsets[-1]]
            + [offsets[i] for i in range(done, len(records)) if settled[i]]
        )
        state.backoff = backoff * 2
        yield _Rewind(partition, offsets[done], min(backoff, limit) if busy else limit)

    def _forget(self, partition: Partition) -> dict[str, Any]:
        """Drop what this member kept for *partition*; return its held leases to release."""
        state = self._partitions.pop(partition, None)
        return {} if state is None else state.held

    def _abandoned(self, partitions: Collection[Partition]) -> Flow[None]:
        """Release the leases held for *partitions* (revoked, or the member stops): their
        records are left to the next owner, from the committed offset."""
        for partition in partitions:
            yield from self.consumer.release_flow(self._forget(partition))

    def _due(self) -> tuple[list[Partition], float | None]:
        """The paused partitions whose delay is over, and the seconds until the next one."""
        now = time.monotonic()
        due: list[Partition] = []
        left: float | None = None
        for part, state in self._partitions.items():
            until = state.paused_until
            if until is None:
                continue
            if until <= now:
                state.paused_until = None
                due.append(part)
            elif left is None or until < left:
                left = until
        return due, (None if left is None else max(0.0, left - now))

    def _paused(self) -> list[Partition]:
        """The partitions paused now (waiting to be fetched again)."""
        return [part for part, state in self._partitions.items() if state.paused_until is not None]

    def _pause(self, partition: Partition, delay: float) -> None:
        state = self._partitions.setdefault(partition, _PartitionState())
        state.paused_until = time.monotonic() + delay

    def _starting(self, stop: threading.Event | asyncio.Event | None) -> None:
        """A run begins (again, after a `close` maybe): it stops when *stop* is set."""
        self._stopping = False
        self._stop = stop

    def _dead_letter(self, record: Any, verdict: Verdict) -> _DeadLetter:
        topic, partition, offset = self._coordinates(record)
        _, _, headers = self._fields(record)
        reason, source_topic, source_partition, source_offset = DEAD_LETTER_HEADERS
        stamped: list[tuple[str, str | bytes | None]] = [
            *headers,
            (reason, str(verdict.reason).encode()),
            (source_topic, topic.encode()),
            (source_partition, str(partition).encode()),
            (source_offset, str(offset).encode()),
        ]
        return _DeadLetter(self._dead_letter_topic(topic), record, stamped)

    def _is_assigned(self, partition: Partition) -> bool:
        stopping = self._stopping or (self._stop is not None and self._stop.is_set())
        return not stopping and partition in self._assigned


class _Held(MutableMapping[str, Any]):
    """The leases *partition* keeps for its blocked records (the *held* of
    `IdempotentConsumer.batch_flow`), seeing those of every partition: a copy of a key in
    another partition runs under the lease kept for it, instead of finding the key busy and
    blocking that partition too (then holding its own records' leases, and so on)."""

    def __init__(self, every: dict[Partition, _PartitionState], partition: Partition) -> None:
        self._every = every
        self._partition = partition
        self._state = every.setdefault(partition, _PartitionState())
        self._own = self._state.held

    def orphaned(self) -> bool:
        """Whether the partition's leases were forgotten (revoked) since, some kept here."""
        return bool(self._own) and self._every.get(self._partition) is not self._state

    def release(self) -> dict[str, Any]:
        """The leases kept here, no longer kept: for `IdempotentConsumer.release_flow`."""
        own, self._own = self._own, {}
        return own

    def _holder(self, key: str) -> dict[str, Any]:
        if key in self._own:
            return self._own
        for state in self._every.values():
            if key in state.held:
                return state.held
        raise KeyError(key)

    def __getitem__(self, key: str) -> Any:
        return self._holder(key)[key]

    def __setitem__(self, key: str, lease: Any) -> None:
        self._own[key] = lease

    def __delitem__(self, key: str) -> None:
        del self._holder(key)[key]

    def __iter__(self) -> Iterator[str]:
        return (key for state in list(self._every.values()) for key in list(state.held))

    def __len__(self) -> int:
        return sum(len(state.held) for state in self._every.values())


def _headers(raw: Any) -> list[tuple[str, bytes]]:
    return [
        (name, value if isinstance(value, bytes) else str(value or "").encode())
        for name, value in (raw or ())
    ]


# -- confluent-kafka ---------------------------------------------------------------------------


class IdempotentKafkaConsumer(_KafkaFlows):
    """A confluent-kafka consumer running a sync *handler* once per key.

    Args:
        config: The consumer's librdkafka configuration; it needs ``bootstrap.servers`` and
            ``group.id``. ``enable.auto.commit`` is forced off: oncely commits.
        topics: The topics to subscribe to.
        handler: Called with each `confluent_kafka.Message` that must take effect.
        store: Where the records are kept.
        producer: Produces dead-lettered records (default: one made from *config*'s
            ``bootstrap.servers`` and security settings).
        scope: The scope of the keys (default: ``kafka:<group.id>``).
        policy: Leases, retention and attempts (`oncely.consumers.ConsumerPolicy`).
        key: Where the key comes from (see `oncely.consumers.KeySource`).
        key_headers: The headers tried for ``key="header"``.
        fingerprint: What defines the operation (default: the canonical value).
        codec: Serialises what the handler returns, for the record.
        dead_letter_topic: A topic name, or a callable from the source topic to one
            (default ``<topic>.dead``). Create it like any topic.
        batch_size: Records fetched per poll.
        poll_timeout: How long a poll waits for records.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Collection[str],
        handler: Callable[[confluent_kafka.Message], Any],
        *,
        store: SyncStore,
        producer: confluent_kafka.Producer | None = None,
        scope: str | None = None,
        policy: ConsumerPolicy | None = None,
        key: KeySource = "header",
        key_headers: tuple[str, ...] = KEY_HEADERS,
        fingerprint: FingerprintSource = "body",
        codec: Codec | None = None,
        dead_letter_topic: str | Callable[[str], str] | None = None,
        batch_size: int = 100,
        poll_timeout: Duration = timedelta(seconds=1),
    ) -> None:
        kafka = require("confluent_kafka", extra="kafka")
        if "group.id" not in config:
            raise ConfigurationError("the consumer configuration needs a group.id")
        if str(config.get("enable.auto.commit", "false")).lower() == "true":
            raise ConfigurationError("enable.auto.commit would commit before completion")
        super().__init__(
            handler,
            store,
            group=str(config["group.id"]),
            scope=scope,
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
            dead_letter_topic=dead_letter_topic,
            batch_size=batch_size,
            poll_timeout=poll_timeout,
        )
        self._kafka = kafka
        self.client: confluent_kafka.Consumer = kafka.Consumer(
            {**config, "enable.auto.commit": False}
        )
        if producer is None:
            shared = {
                name: value
                for name, value in config.items()
                if name == "bootstrap.servers" or name.startswith(("security.", "sasl.", "ssl."))
            }
            producer = kafka.Producer(shared)
        self.producer: confluent_kafka.Producer = producer
        self.client.subscribe(
            list(topics),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )

    def _on_assign(self, _: Any, partitions: list[confluent_kafka.TopicPartition]) -> None:
        self._assigned.update((p.topic, p.partition) for p in partitions)

    def _on_revoke(self, _: Any, partitions: list[confluent_kafka.TopicPartition]) -> None:
        # Called inside consume(): every record fetched before is settled, committed, or left
        # (its leases held for the next round, released now) to the new owner.
        revoked = [(p.topic, p.partition) for p in partitions]
        self._assigned.difference_update(revoked)
        self._resume([part for part in revoked if part in self._paused()])
        self._run(self._abandoned(revoked))

    def _resume(self, partitions: Collection[Partition]) -> None:
        if not partitions:
            return
        try:
            self.client.resume([self._kafka.TopicPartition(*part) for part in partitions])
        except self._kafka.KafkaException as exc:  # no longer assigned: nothing to resume
            logger.warning("resuming %s failed: %s", partitions, exc)

    def _run(self, flow: Flow[Any]) -> Any:
        store: SyncStore = self.consumer._required(SyncStore)
        return run_with(flow, store, self.handler, self._perform)

    def _coordinates(self, record: Any) -> tuple[str, int, int]:
        return record.topic(), record.partition(), record.offset()

    def _fields(self, record: Any) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        return record.value(), record.key(), _headers(record.headers())

    def _perform(self, op: BrokerOp) -> Any:
        if isinstance(op, _Assigned):
            return self._is_assigned(op.partition)
        if isinstance(op, _Commit):
            offset = self._kafka.TopicPartition(*op.partition, op.offset)
            try:
                self.client.commit(offsets=[offset], asynchronous=False)
            except self._kafka.KafkaException as exc:  # revoked meanwhile: the owner redoes it
                logger.warning("commit of %s@%d failed: %s", op.partition, op.offset, exc)
            return None
        if isinstance(op, _Rewind):
            position = self._kafka.TopicPartition(*op.partition, op.offset)
            try:
                self.client.seek(position)
                if op.delay > 0:
                    self.client.pause([position])
                    self._pause(op.partition, op.delay)
            except self._kafka.KafkaException as exc:  # revoked meanwhile: the owner redoes it
                logger.warning("rewind of %s to %d failed: %s", op.partition, op.offset, exc)
            return None
        assert isinstance(op, _DeadLetter)
        errors: list[Any] = []
        self.producer.produce(
            op.topic,
            value=op.record.value(),
            key=op.record.key(),
            headers=op.headers,
            on_delivery=lambda error, _: errors.append(error),
        )
        self.producer.flush(seconds(self.poll_timeout) * 10)
        if not errors or errors[0] is not None:
            raise DeadLetterError(f"producing to {op.topic} failed: {errors or 'timed out'}")
        return None

    def _batch(self, timeout: float) -> dict[Partition, list[Any]]:
        batch: dict[Partition, list[Any]] = {}
        for record in self.client.consume(self.batch_size, timeout):
            error = record.error()
            if error is not None:
                if error.fatal():
                    raise self._kafka.KafkaException(error)
                logger.warning("kafka: %s", error)
                continue
            partition = (record.topic() or "", record.partition() or 0)
            batch.setdefault(partition, []).append(record)
        return batch

    def poll(self, timeout: Duration | None = None) -> int:
        """Fetch a batch (waiting up to *timeout*), settle every record, commit per partition.

        Returns:
            How many records were fetched.
        """
        wait = seconds(timeout if timeout is not None else self.poll_timeout)
        due, left = self._due()
        self._resume(due)
        batch = self._batch(wait if left is None else min(wait, left))
        if not batch:
            return 0
        return int(self._run(self._batch_flow(batch)))

    def run(self, stop: threading.Event) -> None:
        """Poll until *stop* is set; a record being retried is left for the next owner.

        Each poll runs every fetched record at most once, so *stop* is seen within one round
        of handlers, however long the store is unavailable or a record keeps failing.
        """
        self._starting(stop)
        try:
            while not stop.is_set():
                self.poll()
        finally:
            self._stop = None
            self._leave()

    def _leave(self) -> None:
        """Give back what waits for a next round: held leases, paused partitions."""
        self._resume(self._paused())
        self._run(self._abandoned(list(self._partitions)))

    def close(self) -> None:
        """Leave the group (committed offsets stay) and flush the dead-letter producer."""
        self._stopping = True
        self._leave()
        self.client.close()
        self.producer.flush(seconds(self.poll_timeout))


# -- aiokafka ----------------------------------------------------------------------------------


class AsyncIdempotentKafkaConsumer(_KafkaFlows):
    """An aiokafka consumer running an async *handler* once per key.

    Args:
        client: An `aiokafka.AIOKafkaConsumer` created with ``group_id`` and
            ``enable_auto_commit=False``, not subscribed (this class subscribes it, with its
            rebalance listener). Start it after constructing this object.
        topics: The topics to subscribe to.
        handler: Called with each `aiokafka.ConsumerRecord` that must take effect.
        store: Where the records are kept.
        producer: A started `aiokafka.AIOKafkaProducer` for dead-lettered records.
        scope: The scope of the keys (default: ``kafka:<group_id>``).
        policy: Leases, retention and attempts (`oncely.consumers.ConsumerPolicy`).
        key: Where the key comes from (see `oncely.consumers.KeySource`).
        key_headers: The headers tried for ``key="header"``.
        fingerprint: What defines the operation (default: the canonical value).
        codec: Serialises what the handler returns, for the record.
        dead_letter_topic: A topic name, or a callable from the source topic to one
            (default ``<topic>.dead``).
        batch_size: Records fetched per poll.
        poll_timeout: How long a poll waits for records.
        revoke_timeout: How long a revocation waits for the records in flight (default: the
            policy's lease). Keep it below the group's ``rebalance_timeout_ms``.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        client: Any,
        topics: Collection[str],
        handler: Callable[[Any], Awaitable[Any]],
        *,
        store: AsyncStore,
        producer: Any,
        scope: str | None = None,
        policy: ConsumerPolicy | None = None,
        key: KeySource = "header",
        key_headers: tuple[str, ...] = KEY_HEADERS,
        fingerprint: FingerprintSource = "body",
        codec: Codec | None = None,
        dead_letter_topic: str | Callable[[str], str] | None = None,
        batch_size: int = 100,
        poll_timeout: Duration = timedelta(seconds=1),
        revoke_timeout: Duration | None = None,
    ) -> None:
        aiokafka = require("aiokafka", extra="kafka")
        group = getattr(client, "_group_id", None)
        if not group:
            raise ConfigurationError("the AIOKafkaConsumer needs a group_id")
        if getattr(client, "_enable_auto_commit", False):
            raise ConfigurationError("enable_auto_commit=True would commit before completion")
        super().__init__(
            handler,
            store,
            group=str(group),
            scope=scope,
            policy=policy,
            key=key,
            key_headers=key_headers,
            fingerprint=fingerprint,
            codec=codec,
            dead_letter_topic=dead_letter_topic,
            batch_size=batch_size,
            poll_timeout=poll_timeout,
        )
        self.client = client
        self.producer = producer
        self.revoke_timeout = to_timedelta(
            revoke_timeout if revoke_timeout is not None else self.consumer.policy.lease,
            "revoke_timeout",
        )
        self._aiokafka = aiokafka
        self._idle = asyncio.Event()
        self._idle.set()
        client.subscribe(list(topics), listener=_listener(aiokafka, self))

    def _coordinates(self, record: Any) -> tuple[str, int, int]:
        return record.topic, record.partition, record.offset

    def _fields(self, record: Any) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        return record.value, record.key, _headers(record.headers)

    async def _perform(self, op: BrokerOp) -> Any:
        if isinstance(op, _Assigned):
            return self._is_assigned(op.partition)
        if isinstance(op, _Commit):
            offsets = {self._aiokafka.TopicPartition(*op.partition): op.offset}
            try:
                await self.client.commit(offsets)
            except self._aiokafka.errors.KafkaError as exc:  # revoked: the owner redoes it
                logger.warning("commit of %s@%d failed: %s", op.partition, op.offset, exc)
            return None
        if isinstance(op, _Rewind):
            position = self._aiokafka.TopicPartition(*op.partition)
            try:
                self.client.seek(position, op.offset)
                if op.delay > 0:
                    self.client.pause(position)
                    self._pause(op.partition, op.delay)
            except self._aiokafka.errors.KafkaError as exc:  # revoked: the owner redoes it
                logger.warning("rewind of %s to %d failed: %s", op.partition, op.offset, exc)
            return None
        assert isinstance(op, _DeadLetter)
        try:
            await self.producer.send_and_wait(
                op.topic, value=op.record.value, key=op.record.key, headers=op.headers
            )
        except self._aiokafka.errors.KafkaError as exc:
            raise DeadLetterError(f"producing to {op.topic} failed: {exc}") from exc
        return None

    async def apoll(self, timeout: Duration | None = None) -> int:
        """Fetch a batch (waiting up to *timeout*), settle every record, commit per partition.

        Partitions are settled concurrently, the records of one partition in order.

        Returns:
            How many records were fetched.
        """
        wait = seconds(timeout if timeout is not None else self.poll_timeout)
        due, left = self._due()
        self._resume(due)
        if left is not None:
            wait = min(wait, left)
        fetched = await self.client.getmany(
            timeout_ms=int(wait * 1000), max_records=self.batch_size
        )
        batch = {(tp.topic, tp.partition): records for tp, records in fetched.items() if records}
        if not batch:
            return 0
        self._idle.clear()
        try:
            return int(await self._arun(self._batch_flow(batch)))
        finally:
            self._idle.set()

    async def _arun(self, flow: Flow[Any]) -> Any:
        store: AsyncStore = self.consumer._required(AsyncStore)
        return await arun_with(flow, store, self.handler, self._perform)

    def _resume(self, partitions: Collection[Partition]) -> None:
        for part in partitions:
            try:
                self.client.resume(self._aiokafka.TopicPartition(*part))
            except self._aiokafka.errors.KafkaError as exc:  # no longer assigned
                logger.warning("resuming %s failed: %s", part, exc)

    async def arun(self, stop: asyncio.Event | None = None) -> None:
        """Poll until *stop* is set (or the task is cancelled); a record being retried is left
        for the next owner.

        Each poll runs every fetched record at most once, so *stop* is seen within one round
        of handlers, however long the store is unavailable or a record keeps failing.
        """
        self._starting(stop)
        try:
            while stop is None or not stop.is_set():
                await self.apoll()
        finally:
            self._stop = None
            await self._aleave()

    async def _aleave(self) -> None:
        """Give back what waits for a next round: held leases, paused partitions."""
        self._resume(self._paused())
        await self._arun(self._abandoned(list(self._partitions)))

    async def aclose(self) -> None:
        """Stop a run in progress from seeing any more partitions as its own, give back what
        waits for a next round, and stop the client (it leaves the group; committed offsets
        stay). The producer is the caller's to stop."""
        self._stopping = True
        await self._aleave()
        await self.client.stop()

    async def _revoked(self, partitions: Collection[Any]) -> None:
        revoked = [(tp.topic, tp.partition) for tp in partitions]
        self._assigned.difference_update(revoked)
        try:  # the batch ends its round, commits what is done and rewinds the rest
            await asyncio.wait_for(self._idle.wait(), seconds(self.revoke_timeout))
        except asyncio.TimeoutError:
            logger.warning("records still in flight after revocation; their new owner waits")
        self._resume([part for part in revoked if part in self._paused()])
        await self._arun(self._abandoned(revoked))

    def _assigned_now(self, partitions: Collection[Any]) -> None:
        self._assigned.update((tp.topic, tp.partition) for tp in partitions)


def _listener(aiokafka: Any, owner: AsyncIdempotentKafkaConsumer) -> Any:
    """An `aiokafka.ConsumerRebalanceListener` (made here: aiokafka is imported lazily)."""

    class _Rebalance(aiokafka.ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Collection[Any]) -> None:
            await owner._revoked(revoked)

        async def on_partitions_assigned(self, assigned: Collection[Any]) -> None:
            owner._assigned_now(assigned)

    return _Rebalance()
