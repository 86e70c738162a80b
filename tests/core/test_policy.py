"""Policy: frozen, validated, durations in seconds or timedelta."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from oncely import ConfigurationError, Policy


def test_defaults_and_seconds() -> None:
    """Numbers are seconds; defaults match the documentation."""
    policy = Policy(lease=5, ttl=3600.5)
    assert policy.lease == timedelta(seconds=5)
    assert policy.ttl == timedelta(seconds=3600.5)
    assert Policy().on_conflict == "raise"
    assert Policy(final_errors=KeyError).final_errors == (KeyError,)  # type: ignore[arg-type]


def test_frozen() -> None:
    """A policy cannot be changed in place; replace() derives a new one."""
    policy = Policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.lease = timedelta(1)  # type: ignore[misc]
    assert dataclasses.replace(policy, on_conflict="wait").on_conflict == "wait"


@pytest.mark.parametrize(
    "options",
    [
        {"lease": 0},
        {"ttl": -1},
        {"lease": True},
        {"wait_timeout": "5"},
        {"ttl": 1, "lease": 2},
        {"on_conflict": "skip"},
        {"final_errors": ("ValueError",)},
        {"lease": float("nan")},
        {"ttl": float("inf")},
        {"wait_timeout": float("-inf")},
        {"ttl": 1e300},
        {"lease": 0.01},
    ],
)
def test_nonsense_is_rejected(options: dict[str, object]) -> None:
    """Invalid durations, modes and error types raise ConfigurationError."""
    with pytest.raises(ConfigurationError):
        Policy(**options)  # type: ignore[arg-type]


def test_a_short_lease_needs_no_heartbeat() -> None:
    """A lease too short to keep alive is refused, unless the heartbeat is off."""
    assert Policy(lease=0.01, heartbeat=False).lease == timedelta(milliseconds=10)
    with pytest.raises(ConfigurationError, match="too short"):
        Policy(lease=0.01)
