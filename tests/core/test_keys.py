"""Key validation, scoping and the public key helpers."""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

import oncely.keys
from oncely import ConfigurationError, FingerprintError, InvalidKeyError
from oncely._core.fingerprint import canonical_json
from oncely._core.keys import scope_key
from oncely.keys import content_hash, entity_key, from_header, validate_key, windowed


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "x" * 256,
        "tab\tinside",
        "new\nline",
        "nul\x00",
        "del\x7f",
        "ünïcode",
        " leading",
        "trailing ",
        "emoji\U0001f600",
    ],
)
def test_malformed_keys_are_rejected(bad: str) -> None:
    """Empty, over 255 characters, control or non-ASCII characters: InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        validate_key(bad)


@pytest.mark.parametrize("bad", [None, 12, b"bytes", ["list"]])
def test_non_string_keys_are_rejected(bad: object) -> None:
    """A key must be a string."""
    with pytest.raises(InvalidKeyError):
        validate_key(bad)


@pytest.mark.parametrize("good", ["a", "x" * 255, "order-123:charge", "with inner space", "~!{}"])
def test_valid_keys_pass_unchanged(good: str) -> None:
    """Printable ASCII up to 255 characters is accepted as is."""
    assert validate_key(good) == good


def test_invalid_key_error_is_a_value_error() -> None:
    """InvalidKeyError is also a ValueError, so generic handlers catch it."""
    with pytest.raises(ValueError, match="empty"):
        validate_key("")


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("abc-123", "abc-123"),
        ('"abc-123"', "abc-123"),
        ('  "abc"  ', "abc"),
        ('"with \\"quote\\""', 'with "quote"'),
        ('"back\\\\slash"', "back\\slash"),
        (b"bytes-key", "bytes-key"),
    ],
)
def test_from_header_accepts_bare_and_quoted_keys(header: str | bytes, key: str) -> None:
    """Structured-field strings and bare tokens both work."""
    assert from_header(header) == key


@pytest.mark.parametrize(
    "header", ['"unterminated', '"bad \\x escape"', '"in"side"', '""', "", '"end\\"', b"\xff"]
)
def test_from_header_rejects_malformed_values(header: str | bytes) -> None:
    """Malformed quoted strings and non-ASCII bytes: InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        from_header(header)


def test_scoped_keys_do_not_collide() -> None:
    """Different (scope, key) pairs never give the same stored key."""
    pairs = [("a", "b|c"), ("a|b", "c"), ("x" * 100, "k"), ("y" * 100, "k"), ("a", "b")]
    assert len({scope_key(scope, key) for scope, key in pairs}) == len(pairs)


def test_content_hash_is_stable_across_order_and_number_format() -> None:
    """Dict order, 1 versus 1.0, 1.10 versus 1.1 and tuples versus lists do not change it."""
    first = content_hash({"amount": 1.0, "items": (1, 2), "price": 1.10, "b": {"y": 1, "x": 2}})
    second = content_hash({"b": {"x": 2, "y": 1}, "price": 1.1, "items": [1, 2], "amount": 1})
    assert first == second
    assert first.startswith("sha256:")


def test_content_hash_distinguishes_types_and_values() -> None:
    """A string is not a number, true is not 1, and different values differ."""
    hashes = {
        content_hash({"a": "1"}),
        content_hash({"a": 1}),
        content_hash({"a": True}),
        content_hash({"a": 0.1}),
        content_hash({"a": "0.1"}),
        content_hash({"a": None}),
    }
    assert len(hashes) == 6


def test_content_hash_with_chosen_and_excluded_fields() -> None:
    """include= picks the defining fields; exclude= drops volatile ones."""
    a = {"order": 1, "amount": 5, "sent_at": "10:00", "trace": "x"}
    b = {"order": 1, "amount": 5, "sent_at": "10:05", "trace": "y"}
    assert content_hash(a, exclude=["sent_at", "trace"]) == content_hash(
        b, exclude=["sent_at", "trace"]
    )
    assert content_hash(a, include=["order"]) == content_hash(
        {"order": 1, "x": 9}, include=["order"]
    )
    assert content_hash(a) != content_hash(b)


def test_content_hash_of_dataclass_equals_its_fields() -> None:
    """Dataclasses are read as their fields."""

    @dataclasses.dataclass
    class Payment:
        id: str
        cents: int

    assert content_hash(Payment("p", 5)) == content_hash({"cents": 5, "id": "p"})


_PAST_FLOAT = (
    Decimal("1.0000000000000001110223024625156540"),
    Decimal("1.0000000000000001110223024625156541"),
)
"""Two numbers that differ only in their 35th digit (past a 28-digit Decimal context)."""


def test_content_hash_is_exact() -> None:
    """Numbers that differ past a 28-digit context's or a float's precision are two keys, with
    or without chosen fields: the old keys rounded Decimals to 28 digits, and read chosen fields
    back as floats, so two different payloads shared one key."""
    for pair in (_PAST_FLOAT, (Decimal("0.1"), Decimal("0.10000000000000000001"))):
        first, second = ({"order": 1, "rate": rate, "sent_at": "10:00"} for rate in pair)
        assert content_hash(first) != content_hash(second)
        assert content_hash(first, exclude=["sent_at"]) != content_hash(second, exclude=["sent_at"])
        assert content_hash(first, include=["rate"]) != content_hash(second, include=["rate"])
    first = {"rate": _PAST_FLOAT[0]}
    assert content_hash(first, include=["rate"]) == content_hash(
        {"rate": Decimal("1.000000000000000111022302462515654")}, include=["rate"]
    )


def test_content_hash_is_versioned() -> None:
    """The key format carries its version, so no key of the old, lossy format (``sha256:`` and
    the hex digest) ever equals a new one, whatever the prefix."""
    payload = {"order": 7, "amount": 12.5}
    text = canonical_json(payload).encode()
    old = "sha256:" + hashlib.sha256(text).hexdigest()
    new = content_hash(payload)
    assert new == "sha256:v2:" + hashlib.sha256(text).hexdigest()
    assert new != old
    assert content_hash(payload, prefix="") == "v2:" + hashlib.sha256(text).hexdigest()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), object(), {1: "x"}])
def test_content_hash_rejects_values_without_canonical_form(bad: object) -> None:
    """NaN, infinities, arbitrary objects and non-string keys: FingerprintError."""
    with pytest.raises(FingerprintError):
        content_hash(bad)


def test_entity_key() -> None:
    """entity + id + operation (+ version)."""
    assert entity_key("order", 123, "charge") == "order:123:charge"
    assert entity_key("order", "A", "refund", version=2) == "order:A:refund:v2"
    with pytest.raises(InvalidKeyError):
        entity_key("order", "x" * 300, "charge")


def test_windowed_keys_bucket_by_time() -> None:
    """The same window gives the same key; the next window another; naive times are refused."""
    hour = timedelta(hours=1)
    at = datetime(2026, 1, 1, 10, 5, tzinfo=timezone.utc)
    same = datetime(2026, 1, 1, 10, 59, tzinfo=timezone.utc)
    later = datetime(2026, 1, 1, 11, 0, tzinfo=timezone.utc)
    assert windowed("digest", hour, at=at) == windowed("digest", hour, at=same)
    assert windowed("digest", hour, at=at) != windowed("digest", hour, at=later)
    with pytest.raises(ConfigurationError):
        windowed("digest", hour, at=datetime(2026, 1, 1))
    with pytest.raises(ConfigurationError):
        windowed("digest", timedelta(0), at=at)


def test_hashed_turns_any_text_into_a_valid_documented_key() -> None:
    """Over-long and non-ASCII values get a SHA-256 key instead of only a refusal."""
    long_value = "x" * 1000
    key = oncely.keys.hashed(long_value)
    assert key == "sha256:" + hashlib.sha256(long_value.encode()).hexdigest()
    assert oncely.keys.validate_key(key) == key
    assert oncely.keys.hashed("café") == "sha256:" + hashlib.sha256("café".encode()).hexdigest()
    assert oncely.keys.hashed(b"caf\xc3\xa9") == oncely.keys.hashed("café")
    assert oncely.keys.hashed("café", prefix="user:") != oncely.keys.hashed("cafe", prefix="user:")
    assert oncely.keys.hashed("café", prefix="user:").startswith("user:")


@pytest.mark.parametrize("bad", ["x" * 256, "café"])
def test_a_refused_key_points_at_hashed(bad: str) -> None:
    """The error of a too-long or non-ASCII key says how to derive a valid one."""
    with pytest.raises(InvalidKeyError, match=r"oncely\.keys\.hashed"):
        oncely.keys.validate_key(bad)
    with pytest.raises(InvalidKeyError, match=r"oncely\.keys\.hashed"):
        oncely.keys.from_header(bad.encode() if bad.isascii() else bad.encode("utf-8"))
