"""The Kafka clients' shared bookkeeping, without a broker: one state per partition, and the
same start and close for both clients."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from oncely import Status
from oncely._execution import Lease
from oncely.stores.memory import MemoryStore

pytest.importorskip("aiokafka")

from oncely.consumers._kafka_flows import _PartitionState
from oncely.consumers.kafka import AsyncIdempotentKafkaConsumer

LEASE = timedelta(seconds=30)


class _Client:
    """Enough of an `aiokafka.AIOKafkaConsumer` for the adapter's loop: no records ever."""

    _group_id = "g"
    _enable_auto_commit = False

    def __init__(self) -> None:
        self.polls = 0
        self.polled_twice = asyncio.Event()
        self.stopped = False
        self.resumed: list[Any] = []

    def subscribe(self, topics: Any, listener: Any) -> None:
        self.listener = listener

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[Any, Any]:
        self.polls += 1
        if self.polls == 2:
            self.polled_twice.set()
        await asyncio.sleep(0)
        return {}

    def resume(self, partition: Any) -> None:
        self.resumed.append(partition)

    async def stop(self) -> None:
        self.stopped = True


def test_aclose_gives_back_what_waits_and_a_new_run_is_not_stopping() -> None:
    """As the sync client's close and run do: aclose releases the leases kept for blocked
    records, resumes paused partitions, stops the client; a run after it is not stopping."""
    store = MemoryStore()
    client = _Client()

    async def handler(record: Any) -> None:
        return None

    consumer = AsyncIdempotentKafkaConsumer(client, ["t"], handler, store=store, producer=None)
    partition = ("t", 0)
    consumer._assigned_now([type("TP", (), {"topic": "t", "partition": 0})()])
    answer = store.claim("kafka:g|k", "", lease=LEASE, ttl=LEASE)
    state = consumer._partitions.setdefault(partition, _PartitionState())
    state.held["kafka:g|k"] = Lease("kafka:g|k", answer.token, LEASE)  # type: ignore[union-attr]
    consumer._pause(partition, 60.0)

    async def main() -> list[bool]:
        seen = [consumer._is_assigned(partition)]
        await consumer.aclose()
        seen.append(consumer._is_assigned(partition))
        stop = asyncio.Event()

        async def watch() -> None:
            await client.polled_twice.wait()
            seen.append(consumer._is_assigned(partition))
            stop.set()

        await asyncio.gather(consumer.arun(stop), watch())
        return seen

    assert asyncio.run(main()) == [True, False, True]
    assert client.stopped
    assert len(client.resumed) == 1  # the paused partition
    record = store.get("kafka:g|k")
    assert record is not None
    assert record.status is Status.RELEASED
    assert consumer._partitions == {}
