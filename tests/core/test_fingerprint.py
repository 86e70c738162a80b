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

from oncely._core.fingerprint import canonical_document, canonical_json, digest, document_digest
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
