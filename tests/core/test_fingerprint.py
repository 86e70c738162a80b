"""Golden vectors for canonical JSON and fingerprints: changing them breaks stored records."""

from __future__ import annotations

import datetime
import decimal
import enum
import uuid

import pytest

from oncely._core.fingerprint import canonical_json, digest


class Color(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"b": 1, "a": [1.0, 2.50, "x"]}, '{"a":[1,2.5,"x"],"b":1}'),
        (decimal.Decimal("1.10"), "1.1"),
        (decimal.Decimal("1E+2"), "100"),
        (1e-7, "0.0000001"),
        ((1, (2, 3)), "[1,[2,3]]"),
        ({3, 1, 2}, "[1,2,3]"),
        (Color.RED, '"red"'),
        (datetime.date(2026, 1, 2), '"2026-01-02"'),
        (uuid.UUID(int=1), '"00000000-0000-0000-0000-000000000001"'),
        (True, "true"),
        (None, "null"),
        ("é", '"\\u00e9"'),
    ],
)
def test_canonical_json_golden_vectors(value: object, expected: str) -> None:
    """Each value has exactly this spelling."""
    assert canonical_json(value) == expected


def test_digest_golden_vector() -> None:
    """The digest is versioned and stable across releases: stored fingerprints depend on it."""
    golden = "v1:3e00be6f585504c399692039370370e660aee51d13e21041e74ee6a461c58d11"
    assert digest([{"a": 1}, "x"]) == golden
    assert digest([{"a": 1.0}, "x"]) == golden
