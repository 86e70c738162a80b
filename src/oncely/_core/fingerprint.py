"""Canonical JSON and digests: stable across dict order, number formatting and container kind."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from oncely.errors import FingerprintError

__all__ = ["canonical_document", "canonical_json", "digest", "document_digest", "parse_document"]

_PREFIX = "v1:"

_DOCUMENT = json.JSONDecoder(parse_float=decimal.Decimal)
"""Decimals keep every digit of a number, so 0.10000000000000000001 is not 0.1."""

_SORTED = json.JSONEncoder(
    ensure_ascii=True, separators=(",", ":"), sort_keys=True, allow_nan=False
)
"""`canonical_json`'s spelling of documents without decimals, at C speed."""

_FAST_BRACKETS = 100
"""At most this many brackets (so at most this deep), `canonical_json` cannot hit the recursion
limit, so the C encoder, which nests deeper, cannot succeed where it would fail."""


def canonical_json(value: Any) -> str:
    """Serialise *value* as JSON in which equal data has exactly one spelling.

    Dict keys are sorted (they must be strings), tuples and lists are the same, and numbers are
    written in one form: integral values as integers (``1``, ``1.0`` and ``1e0`` agree), others
    as exact, normalised decimals (``1.10`` and ``1.1`` agree). Dataclasses and pydantic models
    are read as their fields; dates, UUIDs, enums and bytes have one stable text form.

    Raises:
        FingerprintError: *value* holds something without a stable canonical form.
    """
    out: list[str] = []
    _write(value, out)
    return "".join(out)


def _write(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=True))
    elif isinstance(value, int) and not isinstance(value, enum.Enum):
        out.append(str(int(value)))
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise FingerprintError(f"{value!r} has no canonical JSON form")
        out.append(_number(decimal.Decimal(repr(value))))
    elif isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise FingerprintError(f"{value!r} has no canonical JSON form")
        out.append(_number(value))
    elif isinstance(value, Mapping):
        entries = []
        for name, item in value.items():
            if not isinstance(name, str):
                raise FingerprintError(f"mapping keys must be strings to fingerprint, not {name!r}")
            entries.append((name, canonical_json(item)))
        entries.sort()
        out.append("{" + ",".join(f"{json.dumps(n)}:{v}" for n, v in entries) + "}")
    elif isinstance(value, (list, tuple)):
        out.append("[" + ",".join(canonical_json(item) for item in value) + "]")
    elif isinstance(value, (set, frozenset)):
        out.append("[" + ",".join(sorted(canonical_json(item) for item in value)) + "]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _write({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, out)
    elif callable(getattr(value, "model_dump", None)) and not isinstance(value, type):
        _write(value.model_dump(mode="json"), out)  # pydantic v2 models
    elif isinstance(value, enum.Enum):
        _write(value.value, out)
    elif isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        _write(value.isoformat(), out)
    elif isinstance(value, datetime.timedelta):
        out.append(_number(decimal.Decimal(value // datetime.timedelta(microseconds=1)).scaleb(-6)))
    elif isinstance(value, uuid.UUID):
        _write(str(value), out)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _write({"$bytes": hashlib.sha256(bytes(value)).hexdigest()}, out)
    else:
        raise FingerprintError(
            f"a value of type {type(value).__qualname__} has no canonical form; choose the "
            "arguments or fields that define the operation explicitly"
        )


def _number(value: decimal.Decimal) -> str:
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def parse_document(source: bytes) -> Any:
    """Parse a JSON request or message body, numbers as Decimals (see `canonical_document`).

    As ``json.loads(source, parse_float=Decimal)``, without building a decoder per call.

    Raises:
        ValueError: *source* is not JSON (`UnicodeDecodeError` included).
    """
    return _DOCUMENT.decode(source.decode(_json_encoding(source), "surrogatepass"))


def _json_encoding(source: bytes) -> str:
    """`json.detect_encoding`, answered at once for the usual body (UTF-8, ``{`` or ``[``)."""
    if source[:1] in (b"{", b"[") and source[1:2] != b"\x00":
        return "utf-8"  # no BOM starts so, and only UTF-16/32 put a zero byte second
    return json.detect_encoding(source)


def canonical_document(document: Any, source: bytes) -> str:
    """``canonical_json(document)`` for a JSON document parsed from *source* with
    ``parse_float=Decimal``: the way request and message bodies are read.

    Such a document holds only dicts, lists, strings, ints, booleans, None, Decimals and (for
    ``NaN`` and ``Infinity``) floats. Without Decimals or floats, `canonical_json` spells it
    exactly as the C encoder does with sorted keys and ASCII escapes (same string escapes, keys
    in code-point order, ints in decimal), so that is tried first; a Decimal (TypeError) or a
    non-finite float (ValueError) falls back to `canonical_json` itself.

    Raises:
        FingerprintError: The document holds ``NaN`` or an infinity.
        RecursionError: It is nested too deeply to fingerprint.
    """
    if source.count(b"[") + source.count(b"{") <= _FAST_BRACKETS:
        try:
            return _SORTED.encode(document)
        except (TypeError, ValueError):
            pass
    return canonical_json(document)


def digest(parts: Iterable[Any]) -> str:
    """Digest the canonical JSON of *parts* into a short versioned fingerprint."""
    return _digest_text(canonical_json(list(parts)))


def document_digest(document: Any, source: bytes) -> str:
    """``digest([document])`` for a document read as `canonical_document` says, faster."""
    return _digest_text(f"[{canonical_document(document, source)}]")


def _digest_text(text: str) -> str:
    return _PREFIX + hashlib.sha256(text.encode("ascii")).hexdigest()
