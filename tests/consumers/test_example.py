"""examples/consumers: one key from an HTTP request through a stream to a consumer, applied once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.redis

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "consumers" / "http_to_consumer.py"


def test_http_key_reaches_the_consumer(redis_url: str, tmp_path: Path) -> None:
    """A crash after publishing makes the client retry: two events, one shipment, one replay."""
    spec = importlib.util.spec_from_file_location("http_to_consumer", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    outcome = example.run(redis_url, tmp_path)
    assert outcome["http"] == [
        "attempt 1: connection lost",
        "201 Created",
        "201 Created (replayed)",
    ]
    assert outcome["published"] == 2
    assert outcome["shipped"] == ["tea"]
    assert outcome["consumer"] == {"processed": 1, "duplicate": 1}
