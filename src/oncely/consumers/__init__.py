"""Idempotent message consumers: a message takes effect once however often it is delivered.

The broker-agnostic decisions (docs/guides/consumers.md) live in `IdempotentConsumer`; one
module per broker translates them into that broker's verbs, and imports its driver only when
it is used:

* `oncely.consumers.rabbitmq`: aio-pika (``oncely[rabbitmq]``)
* `oncely.consumers.kafka`: confluent-kafka and aiokafka (``oncely[kafka]``)
* `oncely.consumers.nats`: nats-py JetStream (``oncely[nats]``)
* `oncely.consumers.redis_streams`: redis-py consumer groups (``oncely[redis]``)
* `oncely.consumers.faststream`: one middleware for FastStream's brokers (``oncely[faststream]``)
* `oncely.consumers.celery`: an idempotent Celery task option (``oncely[celery]``)
* `oncely.consumers.producer`: stamp the key on outgoing messages, for every broker above

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from oncely.consumers._consumer import BATCH_VERBS, IdempotentConsumer
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
)

__all__ = [
    "Action",
    "BATCH_VERBS",
    "ConsumerPolicy",
    "ConsumerStats",
    "Delivery",
    "FingerprintSource",
    "IdempotentConsumer",
    "KEY_HEADERS",
    "KeySource",
    "Reason",
    "Verdict",
]
