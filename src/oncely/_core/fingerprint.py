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

__all__ = ["canonical_json", "digest"]

_PREFIX = "v1:"


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


def digest(parts: Iterable[Any]) -> str:
    """Digest the canonical JSON of *parts* into a short versioned fingerprint."""
    text = canonical_json(list(parts))
    return _PREFIX + hashlib.sha256(text.encode("ascii")).hexdigest()
