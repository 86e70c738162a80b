"""Codecs turn results into bytes for the store, and the outcome envelope frames them.

Stored outcomes are data, never code: the default codec is JSON, and a replayed exception is
rebuilt only as one of the types the user declared final.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "Codec",
    "JSONCodec",
    "Outcome",
    "decode_outcome",
    "encode_error",
    "encode_unavailable",
    "encode_value",
]

_MAGIC = b"oncely1"
_VALUE = b"v"
_ERROR = b"e"
_UNAVAILABLE = b"u"


class Codec(Protocol):
    """Serialises an operation's return value to bytes and back."""

    def encode(self, value: Any) -> bytes:
        """Return *value* as bytes; raise any exception if it cannot be serialised."""
        ...

    def decode(self, data: bytes, annotation: Any) -> Any:
        """Rebuild a value from *data*; *annotation* is the function's return type, or ``Any``."""
        ...


class JSONCodec:
    """JSON, with dataclasses and pydantic models stored as their fields.

    Decoding rebuilds a dataclass or pydantic model when the function's return annotation names
    one (directly, or as ``list[Model]``, ``Model | None`` and the like); other values come back
    as JSON gives them (tuples as lists). Falsy values (``0``, ``""``, ``[]``, ``None``) replay
    exactly.
    """

    def encode(self, value: Any) -> bytes:
        """Serialise *value* as compact UTF-8 JSON."""
        return json.dumps(
            value, default=_to_json, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()

    def decode(self, data: bytes, annotation: Any) -> Any:
        """Parse *data* and rebuild it as *annotation* where that names a known model type."""
        return _rebuild(json.loads(data), annotation)


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and not isinstance(value, type):
        return model_dump(mode="json")
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"values of type {type(value).__qualname__} are not JSON serialisable")


def _rebuild(data: Any, annotation: Any) -> Any:
    if annotation is Any or annotation is None or data is None:
        return data
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is not None:
        if origin in (list, Sequence, set, frozenset) and args and isinstance(data, list):
            items = [_rebuild(item, args[0]) for item in data]
            return origin(items) if origin in (set, frozenset) else items
        if origin is tuple and isinstance(data, list):
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_rebuild(item, args[0]) for item in data)
            if len(args) == len(data):
                return tuple(_rebuild(item, arg) for item, arg in zip(data, args, strict=True))
            return tuple(data)
        if origin is dict and len(args) == 2 and isinstance(data, dict):
            return {name: _rebuild(item, args[1]) for name, item in data.items()}
        if origin is typing.Union or origin is types.UnionType:
            for arg in args:
                if arg is not type(None) and _is_model(arg) and isinstance(data, dict):
                    return _rebuild(data, arg)
        return data
    if isinstance(annotation, type):
        if dataclasses.is_dataclass(annotation) and isinstance(data, dict):
            hints = typing.get_type_hints(annotation)
            fields = {
                f.name: _rebuild(data[f.name], hints.get(f.name, Any))
                for f in dataclasses.fields(annotation)
                if f.name in data
            }
            return annotation(**fields)
        model_validate = getattr(annotation, "model_validate", None)
        if callable(model_validate):
            return model_validate(data)
        if annotation is tuple and isinstance(data, list):
            return tuple(data)
    return data


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and (
        dataclasses.is_dataclass(annotation)
        or callable(getattr(annotation, "model_validate", None))
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """A decoded stored outcome: exactly one of a value body, an error or an unavailable marker.

    Attributes:
        body: The codec's bytes for a returned value (``kind == "value"``).
        error_type: The qualified name of the final exception's type (``kind == "error"``).
        error_args: The exception's JSON-safe arguments (``kind == "error"``).
        reason: Why the value could not be stored (``kind == "unavailable"``).
    """

    kind: typing.Literal["value", "error", "unavailable"]
    body: bytes = b""
    error_type: str = ""
    error_args: tuple[Any, ...] = ()
    reason: str = ""


def encode_value(body: bytes) -> bytes:
    """Frame a codec's bytes as a stored value outcome."""
    return _MAGIC + _VALUE + body


def encode_error(exc: BaseException) -> bytes:
    """Frame a final exception as data: its type's qualified name and its JSON-safe arguments."""
    args: list[Any] = []
    for arg in exc.args:
        try:
            json.dumps(arg, allow_nan=False)
        except (TypeError, ValueError):
            arg = str(arg)
        args.append(arg)
    payload = {"type": qualified_name(type(exc)), "args": args}
    return _MAGIC + _ERROR + json.dumps(payload, separators=(",", ":")).encode()


def encode_unavailable(reason: str) -> bytes:
    """Frame the marker of a result that ran but could not be serialised."""
    return _MAGIC + _UNAVAILABLE + json.dumps({"reason": reason}).encode()


def qualified_name(cls: type) -> str:
    """Return ``module.QualName`` of *cls*, the name stored for final errors."""
    return f"{cls.__module__}.{cls.__qualname__}"


def decode_outcome(data: bytes | None) -> Outcome:
    """Unframe a stored outcome.

    Raises:
        ValueError: *data* is not an outcome written by oncely (a foreign or damaged record).
    """
    if data is None or not data.startswith(_MAGIC) or len(data) <= len(_MAGIC):
        raise ValueError("the stored result is not an oncely outcome")
    kind = data[len(_MAGIC) : len(_MAGIC) + 1]
    rest = data[len(_MAGIC) + 1 :]
    if kind == _VALUE:
        return Outcome("value", body=rest)
    try:
        payload = json.loads(rest)
        if kind == _ERROR:
            return Outcome(
                "error", error_type=str(payload["type"]), error_args=tuple(payload["args"])
            )
        if kind == _UNAVAILABLE:
            return Outcome("unavailable", reason=str(payload["reason"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the stored outcome cannot be decoded: {exc}") from exc
    raise ValueError(f"unknown outcome kind {kind!r}")
