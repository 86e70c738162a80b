"""Bloom filters in process and in Redis: sizing, answers, atomic batches, the measured error."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest

from oncely.bloom import BloomFilter, RedisBloomFilter, bloom_size
from oncely.errors import ConfigurationError
from tests.conftest import service_url


def test_sizing_follows_the_textbook_formula() -> None:
    # 1M keys at 1 %: 9,585,059 bits (1.2 MB), 7 hash functions.
    assert bloom_size(1_000_000, 0.01) == (9_585_059, 7)
    bits, hashes = bloom_size(10_000_000, 0.001)
    assert bits / 10_000_000 == pytest.approx(14.38, abs=0.01)
    assert hashes == 10


@pytest.mark.parametrize(
    ("capacity", "error_rate"),
    [(0, 0.01), (-5, 0.01), (1.5, 0.01), (True, 0.01), (10, 0.0), (10, 1.0), (10, "0.1"), (10, -1)],
)
def test_bad_sizes_are_configuration_errors(capacity: object, error_rate: object) -> None:
    with pytest.raises(ConfigurationError):
        BloomFilter(capacity, error_rate)  # type: ignore[arg-type]


def _false_positives(adds: int, probes: int, filter_: BloomFilter | RedisBloomFilter) -> float:
    batch = 5_000
    for start in range(0, adds, batch):
        filter_.add_many([f"in-{n}" for n in range(start, min(adds, start + batch))])
    wrong = 0
    for start in range(0, probes, batch):
        keys = [f"out-{n}" for n in range(start, min(probes, start + batch))]
        if isinstance(filter_, BloomFilter):
            wrong += sum(filter_.might_contain(key) for key in keys)
        else:
            wrong += sum(filter_.might_contain_many(keys))
    return wrong / probes


def test_in_process_filter_never_forgets_and_errs_at_about_its_rate() -> None:
    bloom = BloomFilter(20_000, 0.01)
    assert bloom.add("a") is True
    assert bloom.add("a") is False
    assert "a" in bloom
    assert bloom.might_contain("a")
    assert bloom.add_many(["b", "b", "c"]) == [True, False, True]
    rate = _false_positives(20_000, 40_000, bloom)
    assert all(bloom.might_contain(f"in-{n}") for n in range(20_000))
    # 400 expected; the bound is loose enough for any hash seed, tight enough to catch a
    # filter sized for another rate (10x) or one that answers "maybe" to everything.
    assert 0.004 < rate < 0.02, rate
    assert bloom.size_bytes == pytest.approx(bloom_size(20_000, 0.01)[0] / 8, rel=0.01)


@pytest.fixture
def redis_filter_name() -> Iterator[str]:
    import redis

    name = f"oncely-test:bloom:{uuid.uuid4().hex}"
    yield name
    client = redis.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
    client.delete(name)
    client.close()


@pytest.mark.redis
def test_redis_filter_answers_like_the_in_process_one(redis_filter_name: str) -> None:
    import redis

    client = redis.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
    bloom = RedisBloomFilter(client, redis_filter_name, 20_000, 0.01)
    assert bloom.might_contain("a") is False
    assert bloom.add("a") is True
    assert bloom.add("a") is False
    assert bloom.might_contain("a") is True
    assert bloom.add_many(["b", "b", "c"]) == [True, False, True]
    assert bloom.add_many([]) == []
    assert bloom.might_contain_many([]) == []
    rate = _false_positives(20_000, 40_000, bloom)
    assert all(bloom.might_contain_many([f"in-{n}" for n in range(20_000)]))
    assert 0.004 < rate < 0.02, rate
    assert client.strlen(redis_filter_name) <= bloom.size_bytes
    client.close()


@pytest.mark.redis
def test_redis_filter_tells_exactly_one_concurrent_adder_a_key_was_new(
    redis_filter_name: str,
) -> None:
    import redis

    keys = [f"k-{n}" for n in range(200)]
    results: list[list[bool]] = []
    start = threading.Barrier(8)

    def adder() -> None:
        client = redis.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
        bloom = RedisBloomFilter(client, redis_filter_name, 10_000, 0.001)
        start.wait()
        results.append(bloom.add_many(keys))
        client.close()

    threads = [threading.Thread(target=adder) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    for index in range(len(keys)):
        assert sum(result[index] for result in results) == 1


@pytest.mark.redis
def test_redis_filter_on_an_asyncio_client(redis_filter_name: str) -> None:
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(service_url("ONCELY_TEST_REDIS_URL"))
        bloom = RedisBloomFilter(client, redis_filter_name, 1_000, 0.01)
        assert await bloom.amight_contain("x") is False
        assert await bloom.aadd("x") is True
        assert await bloom.aadd_many(["x", "y"]) == [False, True]
        assert await bloom.amight_contain_many(["x", "y", "z"]) == [True, True, False]
        assert await bloom.aadd_many([]) == []
        await client.aclose()

    asyncio.run(main())


@pytest.mark.redis_cluster
def test_redis_filter_on_a_cluster() -> None:
    import redis.cluster

    url = service_url("ONCELY_TEST_REDIS_CLUSTER_URL")
    first = url.removeprefix("redis+cluster://").split(",")[0]
    client = redis.cluster.RedisCluster.from_url(f"redis://{first}")
    name = f"oncely-test:bloom:{uuid.uuid4().hex}"
    try:
        bloom = RedisBloomFilter(client, name, 1_000, 0.01)
        assert bloom.add_many(["a", "b", "a"]) == [True, True, False]
        assert bloom.might_contain_many(["a", "c"]) == [True, False]
    finally:
        client.delete(name)
        client.close()


def test_a_filter_too_large_for_one_redis_string_is_refused() -> None:
    class Client:
        def register_script(self, script: str) -> object:
            return None

    with pytest.raises(ConfigurationError, match="at most"):
        RedisBloomFilter(Client(), "x", 1_000_000_000, 0.0001)
    with pytest.raises(ConfigurationError, match="name"):
        RedisBloomFilter(Client(), "", 10, 0.1)
