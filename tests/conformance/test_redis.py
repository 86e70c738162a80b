"""The conformance suite against a real Redis server, a real Redis Cluster, and a tiered store
in front of Redis. The servers' clocks judge leases, so the suite waits for short leases to pass.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from oncely import Store
from oncely.stores import open_store
from oncely.stores.tiered import TieredStore
from oncely.testing import FrozenClock, StoreConformance
from tests.conftest import service_url

REDIS_URL = "ONCELY_TEST_REDIS_URL"
CLUSTER_URL = "ONCELY_TEST_REDIS_CLUSTER_URL"


class _ServerClockConformance(StoreConformance):
    controls_clock = False
    preload = ("redis", "redis.asyncio")
    url_variable: ClassVar[str]

    def store_url(self) -> str:
        return service_url(self.url_variable)

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return open_store(self.store_url(), namespace=namespace)


@pytest.mark.redis
class TestRedisStore(_ServerClockConformance):
    url_variable = REDIS_URL


@pytest.mark.redis_cluster
class TestRedisClusterStore(_ServerClockConformance):
    url_variable = CLUSTER_URL


@pytest.mark.redis
class TestTieredRedisStore(_ServerClockConformance):
    url_variable = REDIS_URL

    def store_url(self) -> str:
        return "tiered+" + super().store_url()

    def open_store(self, clock: FrozenClock | None, namespace: str) -> Store:
        return TieredStore(open_store(service_url(REDIS_URL), namespace=namespace))
