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


def pytest_configure(config: pytest.Config) -> None:
    """Preload drivers in the forkserver the process races use, once for the whole session.

    64 racing processes would otherwise each import the drivers: seconds of CPU on 2 cores.
    """
    import importlib.util
    import multiprocessing

    preload = ["oncely", "oncely._conformance"]
    for module in ("redis", "redis.asyncio", "psycopg", "psycopg_pool"):
        if importlib.util.find_spec(module.partition(".")[0]) is not None:
            preload.append(module)
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
