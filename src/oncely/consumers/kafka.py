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
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Mapping,
)
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from oncely._core.codec import Codec
from oncely._core.flow import Flow
from oncely._core.policy import Duration, to_timedelta
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._deps import require
from oncely._log import get_logger
from oncely.consumers._drivers import BrokerOp, arun_with, run_with
from oncely.consumers._kafka_flows import (
    DEAD_LETTER_HEADERS,
    Partition,
    _Assigned,
    _Commit,
    _DeadLetter,
    _headers,
    _KafkaFlows,
    _Rewind,
)
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    ConsumerPolicy,
    FingerprintSource,
    KeySource,
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


class DeadLetterError(OncelyError):
    """A record could not be produced to the dead-letter topic (it is retried, not skipped)."""


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
