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
