"""What the Kafka consumers (`oncely.consumers.kafka`) share: the per-partition state, the broker
operations, and `_KafkaFlows`: the rounds, rewinds, held leases and dead letters of both clients.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from oncely._core.codec import Codec
from oncely._core.flow import Flow
from oncely._core.policy import Duration, to_timedelta
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._log import fields, get_logger
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._drivers import BrokerOp, Parallel
from oncely.consumers._verdicts import (
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
from oncely.errors import ConfigurationError

logger = get_logger("oncely.consumers.kafka")  # the records keep the public module's name

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
