"""Shared fixtures: service URLs come from the environment (see scripts/services --env)."""

from __future__ import annotations

import os

import pytest


def service_url(name: str) -> str:
    """Return the URL of a test server; a missing one fails the test, it is never skipped."""
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run the tests through scripts/test (it starts servers)")
    return value


RUN_FIRST = (
    "tests/faults/test_campaign.py",
    "tests/test_demo_outbox.py",
    "tests/outbox/test_end_to_end.py",
    "tests/stores/test_postgres.py",
    "tests/stores/test_sqlite.py",
    "tests/stores/test_redis_batch.py",
    "tests/conformance/test_redis.py",
    "tests/consumers/test_kafka.py",
)
"""Files whose tests take seconds each (the fault campaign minutes): on several pytest-xdist
workers they start first, so that no worker begins one near the end while the others idle."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the tests of `RUN_FIRST` ahead, in that order; the rest keep theirs."""
    rank = {path: index for index, path in enumerate(RUN_FIRST)}

    def first(item: pytest.Item) -> int:
        return rank.get(item.nodeid.partition("::")[0], len(rank))

    items.sort(key=first)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reference-flows",
        action="store_true",
        help="run every entry point through the reference flows instead of its fast path "
        "(oncely._switches.reference_flows; also ONCELY_REFERENCE_FLOWS=1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Take the reference flows if asked to; preload drivers in the forkserver the process
    races use, once for the whole session.

    64 racing processes would otherwise each import the drivers and the stores over them:
    seconds of CPU on 2 cores.
    """
    import importlib.util
    import multiprocessing

    from oncely import _switches

    if config.getoption("--reference-flows"):
        # The environment too: processes the tests start (the races, the servers) take it.
        os.environ[_switches.REFERENCE_FLOWS_VARIABLE] = "1"
        _switches.reference_flows = True

    preload = ["oncely", "oncely.testing._calls", "oncely.stores.sqlite"]
    drivers = {
        "redis": ("redis", "redis.asyncio", "oncely.stores.redis"),
        "psycopg": ("psycopg", "psycopg_pool", "oncely.stores.postgres"),
    }
    for driver, modules in drivers.items():
        if importlib.util.find_spec(driver) is not None:
            preload.extend(modules)
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
