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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from oncely.errors import FingerprintError

__all__ = [
    "MAX_DEPTH",
    "body_digest",
    "canonical_body",
    "canonical_document",
    "canonical_json",
    "arguments_digest",
    "digest",
    "document_digest",
    "parse_document",
]

_PREFIX = "v1:"

MAX_DEPTH = 200
"""The deepest nesting of containers that has a canonical form. Deeper values raise
`FingerprintError` (and bodies nested deeper are identified by their bytes), always: the limit
is far below the interpreter's recursion limit, so where a value stands never depends on how
deep the caller's stack happens to be."""

_PLAIN_ZEROS = 100
"""Numbers are spelt without an exponent (``100``, ``0.001``) when that takes at most this many
zeros besides their significant digits, else with one (``1e1000000``): a spelling never costs
more than a small multiple of the number's own length."""

_ZEROS = "0" * (_PLAIN_ZEROS + 1)
_ZERO_BYTES = _ZEROS.encode("ascii")

_DOCUMENT = json.JSONDecoder(parse_float=decimal.Decimal)
"""Decimals keep every digit of a number, so 0.10000000000000000001 is not 0.1."""

_SCAN: Callable[[str, int], tuple[Any, int]] = vars(_DOCUMENT)["scan_once"]
"""`_DOCUMENT`'s scanner, which `JSONDecoder.raw_decode` calls after skipping whitespace."""

_OPENERS = ("{", "[")

_SORTED = json.JSONEncoder(
    ensure_ascii=True, separators=(",", ":"), sort_keys=True, allow_nan=False
)
"""`canonical_json`'s spelling of documents without decimals, at C speed."""

_FAST_BRACKETS = 100
"""At most this many brackets (so at most this deep, below `MAX_DEPTH`), `canonical_json` cannot
refuse a document for its depth, so the C encoder, which nests deeper, cannot succeed where it
would fail."""


def canonical_json(value: Any) -> str:
    """Serialise *value* as JSON in which equal data has exactly one spelling.

    Dict keys are sorted (they must be strings), tuples and lists are the same, and numbers are
    written exactly, in one form: integral values as integers (``1``, ``1.0`` and ``1e0``
    agree), others as normalised decimals (``1.10`` and ``1.1`` agree), every significant digit
    kept; a number that would need more than a hundred zeros is written with an exponent
    instead (``1e1000000``), so no spelling costs more than a small multiple of the number's
    own length. Dataclasses and pydantic models are read as their fields; dates, UUIDs, enums
    and bytes have one stable text form.

    Raises:
        FingerprintError: *value* holds something without a stable canonical form, or is nested
            deeper than `MAX_DEPTH`.
    """
    out: list[str] = []
    _write(value, out, 0)
    return "".join(out)


def _write(value: Any, out: list[str], depth: int) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=True))
    elif isinstance(value, int) and not isinstance(value, enum.Enum):
        text = str(int(value))
        out.append(_integer(text) if text.endswith(_ZEROS) else text)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise FingerprintError(f"{value!r} has no canonical JSON form")
        out.append(_decimal_text(repr(value)))
    elif isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise FingerprintError(f"{value!r} has no canonical JSON form")
        out.append(_decimal_text(str(value)))
    elif isinstance(value, Mapping):
        depth = _deeper(depth)
        for name in value:
            if not isinstance(name, str):
                raise FingerprintError(f"mapping keys must be strings to fingerprint, not {name!r}")
        out.append("{")
        for number, (name, item) in enumerate(sorted(value.items(), key=_name)):
            out.append(f"{json.dumps(name)}:" if number == 0 else f",{json.dumps(name)}:")
            _write(item, out, depth)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        depth = _deeper(depth)
        out.append("[")
        for number, item in enumerate(value):
            if number:
                out.append(",")
            _write(item, out, depth)
        out.append("]")
    elif isinstance(value, (set, frozenset)):
        depth = _deeper(depth)
        items = []
        for item in value:
            spelt: list[str] = []
            _write(item, spelt, depth)
            items.append("".join(spelt))
        out.append("[" + ",".join(sorted(items)) + "]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _write({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, out, depth)
    elif callable(getattr(value, "model_dump", None)) and not isinstance(value, type):
        _write(value.model_dump(mode="json"), out, depth)  # pydantic v2 models
    elif isinstance(value, enum.Enum):
        _write(value.value, out, depth)
    elif isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        _write(value.isoformat(), out, depth)
    elif isinstance(value, datetime.timedelta):
        micro = value // datetime.timedelta(microseconds=1)
        out.append(_decimal_text(f"{micro}E-6"))
    elif isinstance(value, uuid.UUID):
        _write(str(value), out, depth)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _write({"$bytes": hashlib.sha256(bytes(value)).hexdigest()}, out, depth)
    else:
        raise FingerprintError(
            f"a value of type {type(value).__qualname__} has no canonical form; choose the "
            "arguments or fields that define the operation explicitly"
        )


def _name(entry: tuple[str, Any]) -> str:
    return entry[0]


def _deeper(depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise FingerprintError(f"the value is nested deeper than {MAX_DEPTH} levels")
    return depth + 1


def _integer(text: str) -> str:
    """The spelling of an integer written in full as *text*, which ends in many zeros."""
    digits = text.rstrip("0")
    return _spell(digits.lstrip("-"), len(text) - len(digits), "-" if text[0] == "-" else "")


def _decimal_text(text: str) -> str:
    """The spelling of the finite number *text*, as `decimal.Decimal` or `repr` writes it
    (``-1.2300E+5``, ``0.00012``, ``1e+300``): computed on its digits, exactly, without ever
    expanding its exponent."""
    sign = ""
    if text[0] in "+-":
        sign = "-" if text[0] == "-" else ""
        text = text[1:]
    mantissa, _, exponent_text = text.replace("E", "e").partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    significant = digits.rstrip("0")
    if not significant:
        return "0"
    exponent = int(exponent_text or "0") - len(fraction) + len(digits) - len(significant)
    return _spell(significant, exponent, sign)


def _spell(digits: str, exponent: int, sign: str) -> str:
    """The one spelling of ``sign digits * 10**exponent`` (*digits* without leading or
    trailing zeros): as today's plain decimals while that needs at most `_PLAIN_ZEROS` zeros
    besides the digits, else ``d.ddde±x``."""
    if exponent >= 0:
        if exponent <= _PLAIN_ZEROS:
            return f"{sign}{digits}{'0' * exponent}"
    else:
        point = len(digits) + exponent
        if point > 0:
            return f"{sign}{digits[:point]}.{digits[point:]}"
        if -point <= _PLAIN_ZEROS:
            return f"{sign}0.{'0' * -point}{digits}"
    scientific = exponent + len(digits) - 1
    fraction = f".{digits[1:]}" if len(digits) > 1 else ""
    return f"{sign}{digits[0]}{fraction}e{scientific}"


def parse_document(source: bytes) -> Any:
    """Parse a JSON request or message body, numbers as Decimals (see `canonical_document`).

    As ``json.loads(source, parse_float=Decimal)``, without building a decoder per call.

    Raises:
        ValueError: *source* is not JSON (`UnicodeDecodeError` included), holds a number
            beyond what `decimal.Decimal` represents (an exponent over 10**18) or an integer of
            more digits than Python converts, or nests too deeply for the parser.
    """
    text = source.decode(_json_encoding(source), "surrogatepass")
    try:
        if text[:1] in _OPENERS:  # the usual body: no whitespace around, so no regex to skip it
            document, end = _SCAN(text, 0)
            if end == len(text):
                return document
        return _DOCUMENT.decode(text)
    except StopIteration as exc:  # as `JSONDecoder.raw_decode` says it
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    except RecursionError:
        raise ValueError("the JSON document nests too deeply to be read") from None
    except decimal.InvalidOperation:
        raise ValueError("the JSON document holds a number out of range") from None


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
    non-finite float (ValueError) falls back to `canonical_json` itself, and so does a source
    with a long run of zeros (an integer that `canonical_json` may write with an exponent).

    Raises:
        FingerprintError: The document holds ``NaN`` or an infinity, or is nested deeper than
            `MAX_DEPTH`.
    """
    if len(source) <= _FAST_BRACKETS or (  # too short to hold more brackets, or the zeros
        source.count(b"[") + source.count(b"{") <= _FAST_BRACKETS and _ZERO_BYTES not in source
    ):
        try:
            if _ENCODE_SORTED is None:
                return _SORTED.encode(document)
            # A parsed document holds no cycles: the encoder made once, without their check.
            return "".join(_ENCODE_SORTED(document, 0))
        except (TypeError, ValueError):
            pass
    return canonical_json(document)


def canonical_body(source: bytes) -> str | None:
    """The canonical JSON of a request or message body, or ``None`` when it has none: it is not
    JSON (or not UTF-8, -16 or -32), holds ``NaN``, an infinity or a number out of range, or
    nests deeper than `MAX_DEPTH`. Such a body is identified by its bytes instead.

    The work is linear in the size of *source*: numbers are never expanded (see
    `canonical_json`) and nesting is bounded.
    """
    try:
        return canonical_document(parse_document(source), source)
    except (ValueError, FingerprintError):
        return None


def digest(parts: Iterable[Any]) -> str:
    """Digest the canonical JSON of *parts* into a short versioned fingerprint."""
    return _digest_text(canonical_json(list(parts)))


_FLAT_INT = 10**_PLAIN_ZEROS
"""Integers smaller than this in magnitude have fewer than `_PLAIN_ZEROS` + 1 digits, so
`canonical_json` spells them as ``str`` does."""

_C_MAKE_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)
"""The C JSON encoder's maker (``None`` where the interpreter has none)."""

_ENCODE_SORTED = (
    _C_MAKE_ENCODER(
        None,
        _SORTED.default,
        json.encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        True,
        False,
        False,
    )
    if _C_MAKE_ENCODER is not None
    else None
)
"""`_SORTED`'s C encoder made once (`JSONEncoder.encode` makes one per call), without its
check for cycles: it only ever sees a list holding one flat dict, or a parsed document."""


def arguments_digest(arguments: dict[str, Any]) -> str:
    """``digest([arguments])``, at C speed when every value is a string, a ``bool``, ``None``
    or an ``int`` of at most a hundred digits: then the C encoder with sorted keys spells the
    dict exactly as `canonical_json` does (same string escapes, keys in code-point order,
    integers in decimal). Anything else takes `digest` itself."""
    if _ENCODE_SORTED is not None:
        for value in arguments.values():
            kind = type(value)
            if kind is str or kind is bool or value is None:
                continue
            if kind is int and -_FLAT_INT < value < _FLAT_INT:
                continue
            break
        else:
            for name in arguments:
                if type(name) is not str:
                    break
            else:
                return _digest_text("".join(_ENCODE_SORTED([arguments], 0)))
    return digest([arguments])


def document_digest(document: Any, source: bytes) -> str:
    """``digest([document])`` for a document read as `canonical_document` says, faster."""
    return _digest_text(f"[{canonical_document(document, source)}]")


def body_digest(source: bytes) -> str:
    """``digest([document])`` of a message body that is JSON (see `canonical_body`), else
    ``digest([source])``: the body's bytes."""
    text = canonical_body(source)
    return digest([source]) if text is None else _digest_text(f"[{text}]")


def _digest_text(text: str) -> str:
    return _PREFIX + hashlib.sha256(text.encode("ascii")).hexdigest()
