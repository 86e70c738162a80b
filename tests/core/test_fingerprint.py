"""Golden vectors for canonical JSON and fingerprints: changing them breaks stored records."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oncely._core import fingerprint
from oncely._core.fingerprint import (
    canonical_document,
    canonical_json,
    digest,
    document_digest,
    parse_document,
)
from oncely.errors import FingerprintError


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


# Documents as JSON parsers return them with parse_float=Decimal (the way bodies are read).
_documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.decimals(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_documents)
def test_canonical_document_spells_as_canonical_json(document: object) -> None:
    """The C-speed path never changes a fingerprint: same text as `canonical_json`, always."""
    source = json.dumps(document, default=str).encode()
    assert canonical_document(document, source) == canonical_json(document)
    assert document_digest(document, source) == digest([document])


def test_canonical_document_of_deep_documents_and_non_finite_numbers() -> None:
    """Past the bracket limit the pure path decides (and may refuse); NaN never fingerprints."""
    deep: object = 1
    for _ in range(150):
        deep = [deep]
    source = json.dumps(deep).encode()
    assert canonical_document(deep, source) == canonical_json(deep)
    with pytest.raises(FingerprintError):
        canonical_document({"n": float("nan")}, b'{"n": NaN}')


# -- numbers: exact, one spelling, never expanded -------------------------------------------------

_PAST_FLOAT = (
    b"1.0000000000000001110223024625156540",
    b"1.0000000000000001110223024625156541",
)
"""Two numbers that differ in their 35th digit (and even as floats they differ)."""


@pytest.mark.parametrize(
    "spellings",
    [
        [b"1", b"1.0", b"1e0", b"10e-1", b"1.000", b"0.1e1", b"100E-2"],
        [b"1.1", b"1.10", b"11e-1", b"0.0011e3"],
        [b"0", b"-0", b"0.0", b"0e10", b"-0.0e-5"],
        [b"100", b"1e2", b"1E+2", b"100.00"],
        [b"-2.5", b"-25e-1", b"-0.25E1"],
    ],
)
def test_equal_numbers_have_one_spelling(spellings: list[bytes]) -> None:
    """However a number is written in a body, equal values canonicalise alike."""
    texts = {canonical_document(parse_document(text), text) for text in spellings}
    assert len(texts) == 1, texts


def test_numbers_keep_every_digit() -> None:
    """No rounding to 28 (or 17) significant digits: the two 35-digit numbers differ."""
    first, second = (canonical_document(parse_document(text), text) for text in _PAST_FLOAT)
    assert first == _PAST_FLOAT[0].decode().rstrip("0")
    assert second == _PAST_FLOAT[1].decode()
    assert canonical_json(decimal.Decimal(_PAST_FLOAT[0].decode())) != canonical_json(
        decimal.Decimal(_PAST_FLOAT[1].decode())
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (b"1e1000000", "1e1000000"),
        (b"-1E+1000000", "-1e1000000"),
        (b"12.5e999999", "1.25e1000000"),
        (b"1e-1000000", "1e-1000000"),
        (b"[1e5000, 1e-5000]", "[1e5000,1e-5000]"),
        (b"1e100", "1" + "0" * 100),
        (b"1e101", "1e101"),
        (b"1e-101", "0." + "0" * 100 + "1"),
        (b"1e-102", "1e-102"),
    ],
)
def test_huge_exponents_are_never_expanded(source: bytes, expected: str) -> None:
    """A 9-byte number spells in a few bytes: its exponent is never expanded into digits (the
    old code built a million-digit integer for ``1e1000000``, for seconds)."""
    assert canonical_document(parse_document(source), source) == expected


def test_integers_with_many_zeros_spell_as_the_same_decimal() -> None:
    """``1`` followed by 200 zeros and ``1e200`` are one number, with one spelling."""
    whole = b"[1" + b"0" * 200 + b"]"
    assert canonical_document(parse_document(whole), whole) == "[1e200]"
    assert canonical_json(10**200) == canonical_json(decimal.Decimal("1e200")) == "1e200"
    assert canonical_json(-(10**200)) == "-1e200"


_finite = st.decimals(allow_nan=False, allow_infinity=False)


@given(_finite, _finite)
def test_canonical_numbers_are_exact(first: decimal.Decimal, second: decimal.Decimal) -> None:
    """One spelling per value, a different one for every other value, read back exactly."""
    spelt = canonical_json(first)
    assert decimal.Decimal(spelt) == first
    assert (spelt == canonical_json(second)) == (first == second)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_spell_as_their_shortest_decimal(value: float) -> None:
    """A float is the decimal its repr writes, exactly as that Decimal."""
    assert canonical_json(value) == canonical_json(decimal.Decimal(repr(value)))


@pytest.mark.parametrize(
    "source",
    [b"[1e99999999999999999999999]", b"[" * 100_000 + b"]" * 100_000, b"1" * 5000],
)
def test_unreadable_documents_are_value_errors(source: bytes) -> None:
    """A number out of Decimal's range, nesting past the parser's recursion, an integer too long
    to convert: a ValueError (read as bytes by every caller), never another exception."""
    with pytest.raises(ValueError):
        parse_document(source)
    assert fingerprint.canonical_body(source) is None


def test_depth_is_bounded_whatever_the_stack() -> None:
    """Up to MAX_DEPTH levels a document has a canonical form; deeper ones never do, at any
    stack depth of the caller (the bound is not the interpreter's recursion limit)."""
    limit = fingerprint.MAX_DEPTH
    deepest = b"[" * limit + b"]" * limit
    too_deep = b"[" * (limit + 1) + b"]" * (limit + 1)

    def nested(levels: int) -> tuple[str | None, str | None]:
        if levels:
            return nested(levels - 1)
        return fingerprint.canonical_body(deepest), fingerprint.canonical_body(too_deep)

    for levels in (0, 300):
        assert nested(levels) == (deepest.decode(), None)
    with pytest.raises(FingerprintError, match="deeper"):
        canonical_json(json.loads(too_deep))


_FLAT_VALUES = st.one_of(
    st.text(),
    st.booleans(),
    st.none(),
    st.integers(),
    st.integers(min_value=-(10**120), max_value=10**120),
    st.just(10**100),
    st.just(-(10**100) + 1),
    st.just(7 * 10**101),
    st.floats(allow_nan=False),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
    st.sampled_from([(), b"x", {"n": 1}]),
)


@given(st.dictionaries(st.text(), _FLAT_VALUES, max_size=6))
def test_arguments_digest_is_the_digest_of_the_arguments(arguments: dict[str, object]) -> None:
    try:
        expected = fingerprint.digest([arguments])
    except FingerprintError:
        with pytest.raises(FingerprintError):
            fingerprint.arguments_digest(arguments)
        return
    assert fingerprint.arguments_digest(arguments) == expected


def test_arguments_digest_of_values_the_c_encoder_would_spell_otherwise() -> None:
    class Text(str):
        pass

    for value in (1.0, True, 10**100, enum.IntEnum("E", "A").A, Text("x"), decimal.Decimal("1.0")):
        arguments = {"a": value, "b": "x"}
        assert fingerprint.arguments_digest(arguments) == fingerprint.digest([arguments])
