"""Codecs turn results into bytes for the store, and the outcome envelope frames them.

Stored outcomes are data, never code: the default codec is JSON, and a replayed exception is
rebuilt only as one of the types the user declared final.
"""

from __future__ import annotations

import base64
import collections.abc
import contextlib
import dataclasses
import datetime
import decimal
import enum
import json
import json.scanner
import math
import sys
import types
import typing
import uuid
from collections.abc import Callable, Sequence
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
    """JSON that describes its own types, so a replay returns what the first call returned.

    Plain JSON values (``str``, ``int``, finite ``float``, ``bool``, ``None``, lists and dicts
    with string keys) are stored as themselves. Everything else a function commonly returns is
    stored as a small tagged object (``{"$t": "decimal", "v": "12.50"}``) and rebuilt as the same
    type: ``tuple``, ``set``, ``frozenset``, dicts with other keys, ``bytes``, ``bytearray``,
    ``Decimal``, NaN and infinities, ``datetime`` (with its ``ZoneInfo`` zone), ``date``,
    ``time``, ``timedelta``, ``UUID``, enums, dataclasses, named tuples and pydantic models, at
    any depth, with or without a return annotation.

    Classes (enums, dataclasses, named tuples, pydantic models) are stored by qualified name and
    found again only among modules already imported, and only if they are of that kind: decoding
    never imports a module or builds any other type. Anything else is refused when encoding
    (`TypeError`), so an unstorable result is known at the first call, not at a replay.
    """

    def encode(self, value: Any) -> bytes:
        """Serialise *value* as compact UTF-8 JSON with type tags where JSON has no type."""
        return _dumps(_tagged(value)).encode()

    def decode(self, data: bytes, annotation: Any) -> Any:
        """Parse *data*, rebuilding tagged values; *annotation* rebuilds untagged older records."""
        # Every tag spells "$t": without it the document is plain JSON, parsed at C speed.
        # (``find``, not ``in``: bytes' ``in`` first tries its operand as an int, and formats
        # the error it then drops.)
        text = data.decode()
        value = _PLAIN_LOADS(text) if data.find(b'"$t"') < 0 else _LOADS(text)
        if annotation is Any or annotation is None or _as_parsed(annotation):
            return value  # what `_rebuild` would return: nothing in it to rebuild
        return _rebuild(value, annotation)  # records written before the values carried types

    def check(self, annotation: Any) -> None:
        """Raise `TypeError` if a function annotated to return *annotation* cannot be stored."""
        _check_annotation(annotation, set())


_TAG = "$t"
_C_MAKE_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_C_DUMPS = (
    _C_MAKE_ENCODER(
        None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", False, False, False
    )
    if _C_MAKE_ENCODER is not None
    else None
)
"""`_ENCODER`'s C encoder made once (`JSONEncoder.encode` makes one per call). It has no check
for cycles: it only encodes what `_tagged` built, which is a tree (a cycle fails in `_tagged`)."""


def _dumps(value: Any) -> str:
    return _ENCODER.encode(value) if _C_DUMPS is None else "".join(_C_DUMPS(value, 0))


_AS_PARSED = frozenset({dict, list, str, int, float, bool, object, type(None)})


def _as_parsed(annotation: Any) -> bool:
    """Whether `_rebuild` returns any parsed document as it is for *annotation* (remembered)."""
    try:
        return _PARSED_AS_IS[annotation]
    except KeyError:
        plain = _PARSED_AS_IS[annotation] = _leaves_parsed(annotation)
        return plain
    except TypeError:  # an annotation that cannot be a key
        return False


_PARSED_AS_IS: dict[Any, bool] = {}


def _leaves_parsed(annotation: Any) -> bool:
    if annotation is Any or annotation is None:
        return True
    if type(annotation) is type:
        return annotation in _AS_PARSED
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, Sequence):
        return all(_leaves_parsed(arg) for arg in args)
    if origin is dict:
        return len(args) != 2 or _leaves_parsed(args[1])
    if origin is typing.Union or origin is types.UnionType:
        return not any(_is_model(arg) for arg in args)
    return False


def _tag(kind: str, value: Any, cls: type | None = None) -> dict[str, Any]:
    if cls is None:
        return {_TAG: kind, "v": value}
    return {_TAG: kind, "c": _NAMES.get(cls) or _class_name(cls), "v": value}


_AS_IS = frozenset({str, int, bool, type(None)})
"""Types stored as themselves, with nothing to look at inside."""


def _tagged(value: Any) -> Any:
    """*value* as plain JSON data, with a tag wherever JSON would lose the type."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind is float:
        return value if math.isfinite(value) else _tag("float", repr(value))
    if kind is list:
        return [item if type(item) in _AS_IS else _tagged(item) for item in value]
    if kind is dict:
        for name, item in value.items():
            if type(name) is not str or name == _TAG or type(item) not in _AS_IS:
                break
        else:
            return value  # nothing in it to tag (the common record of strings and numbers)
        plain: dict[str, Any] = {}
        for name, item in value.items():
            if type(name) is not str or name == _TAG:
                break
            plain[name] = item if type(item) in _AS_IS else _tagged(item)
        else:
            return plain
        return _tag("map", [[_tagged(name), _tagged(item)] for name, item in value.items()])
    if kind is tuple:
        return _tag("tuple", [_tagged(item) for item in value])
    simple = _SIMPLE_ENCODERS.get(kind)
    if simple is not None:
        return simple(value)
    if isinstance(value, enum.Enum):
        return _tag("enum", _tagged(value.value), kind)
    if isinstance(value, tuple) and _is_named_tuple(kind):
        return _tag("namedtuple", [_tagged(item) for item in value], kind)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELDS.get(kind) or _field_names(kind)
        return _tag("dataclass", {name: _tagged(getattr(value, name)) for name in names}, kind)
    if _is_pydantic(kind):
        return _tag("pydantic", _tagged(value.model_dump(mode="python", round_trip=True)), kind)
    raise TypeError(
        f"values of type {kind.__module__}.{kind.__qualname__} cannot be stored: return JSON "
        "data, a standard type (Decimal, datetime, UUID, bytes, set, tuple, ...), an enum, a "
        "dataclass, a named tuple or a pydantic model, or pass a codec that can store it"
    )


def _datetime(value: datetime.datetime) -> dict[str, Any]:
    zone = getattr(value.tzinfo, "key", None)
    tagged = _tag("datetime", value.isoformat())
    if isinstance(zone, str) and type(value.tzinfo).__name__ == "ZoneInfo":
        tagged["z"] = zone  # the zone itself; its fold follows from the offset in "v"
    elif value.fold:
        tagged["f"] = 1
    return tagged


def _time(value: datetime.time) -> dict[str, Any]:
    tagged = _tag("time", value.isoformat())
    if value.fold:
        tagged["f"] = 1
    return tagged


_SIMPLE_ENCODERS: dict[type, Callable[[Any], Any]] = {
    set: lambda value: _tag("set", [_tagged(item) for item in value]),
    frozenset: lambda value: _tag("frozenset", [_tagged(item) for item in value]),
    bytes: lambda value: _tag("bytes", base64.b64encode(value).decode("ascii")),
    bytearray: lambda value: _tag("bytearray", base64.b64encode(value).decode("ascii")),
    decimal.Decimal: lambda value: _tag("decimal", str(value)),
    datetime.datetime: _datetime,
    datetime.date: lambda value: _tag("date", value.isoformat()),
    datetime.time: _time,
    datetime.timedelta: lambda value: _tag(
        "timedelta", [value.days, value.seconds, value.microseconds]
    ),
    uuid.UUID: lambda value: _tag("uuid", str(value)),
}


def _class_name(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    if _find_class(name) is not cls:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} cannot be stored: a replay finds classes by "
            "module and name, and this one is not reachable so (define it at module level)"
        )
    _NAMES[cls] = name
    return name


_NAMES: dict[type, str] = {}
"""Stored names of the classes encoded so far (each checked once to be found again by name)."""


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


_FIELDS: dict[type, tuple[str, ...]] = {}


def _find_class(name: str) -> Any:
    """The class *name* (``module:Qual.Name``) names, among already imported modules only.

    Looked up every time, not cached: a class defined again under its name (a notebook cell
    or a script run again in one process, a reloaded module) is the one the name now means.
    """
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        if found is None or part.startswith("<"):
            return None
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def _stored_class(data: dict[str, Any], accept: Callable[[type], bool]) -> Any:
    name = data.get("c")
    cls = _find_class(str(name))
    if cls is not None and _ACCEPTED.get((cls, accept)):
        return cls
    if cls is None or not accept(cls):
        raise ValueError(f"the stored class {name!r} is not a loaded class of its kind")
    _ACCEPTED[(cls, accept)] = True
    return cls


_ACCEPTED: dict[tuple[type, Callable[[type], bool]], bool] = {}


def _is_named_tuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")


def _is_pydantic(cls: type) -> bool:
    return callable(getattr(cls, "model_validate", None)) and callable(
        getattr(cls, "model_dump", None)
    )


def _dataclass(data: dict[str, Any]) -> Any:
    cls = _stored_class(data, _is_dataclass)
    values: dict[str, Any] = data["v"]
    init, later = _INIT_FIELDS.get(cls) or _init_fields(cls)
    instance = cls(**{name: values[name] for name in init if name in values})
    for name in later:
        if name in values:
            object.__setattr__(instance, name, values[name])
    return instance


def _is_dataclass(cls: type) -> bool:
    return dataclasses.is_dataclass(cls)


def _is_enum(cls: type) -> bool:
    return issubclass(cls, enum.Enum)


def _init_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = dataclasses.fields(cls)
    split = _INIT_FIELDS[cls] = (
        tuple(f.name for f in fields if f.init),
        tuple(f.name for f in fields if not f.init),
    )
    return split


_INIT_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _datetime_from(data: dict[str, Any]) -> datetime.datetime:
    value = datetime.datetime.fromisoformat(data["v"])
    zone = data.get("z")
    if zone is not None and value.tzinfo is not None:
        import zoneinfo

        return value.astimezone(zoneinfo.ZoneInfo(zone))
    return value.replace(fold=1) if data.get("f") else value


_DECODERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "map": lambda data: {name: item for name, item in data["v"]},
    "tuple": lambda data: tuple(data["v"]),
    "set": lambda data: set(data["v"]),
    "frozenset": lambda data: frozenset(data["v"]),
    "float": lambda data: float(data["v"]),
    "bytes": lambda data: base64.b64decode(data["v"], validate=True),
    "bytearray": lambda data: bytearray(base64.b64decode(data["v"], validate=True)),
    "decimal": lambda data: decimal.Decimal(data["v"]),
    "datetime": _datetime_from,
    "date": lambda data: datetime.date.fromisoformat(data["v"]),
    "time": lambda data: datetime.time.fromisoformat(data["v"]).replace(fold=data.get("f", 0)),
    "timedelta": lambda data: datetime.timedelta(*data["v"]),
    "uuid": lambda data: uuid.UUID(data["v"]),
    "enum": lambda data: _stored_class(data, _is_enum)(data["v"]),
    "namedtuple": lambda data: _stored_class(data, _is_named_tuple)._make(data["v"]),
    "dataclass": _dataclass,
    "pydantic": lambda data: _stored_class(data, _is_pydantic).model_validate(data["v"]),
}


def _untagged(data: dict[str, Any]) -> Any:
    kind = data.get(_TAG)
    if kind is None:
        return data
    decoder = _DECODERS.get(kind) if type(kind) is str else None
    if decoder is None:
        raise ValueError(f"unknown stored type tag {kind!r}")
    try:
        return decoder(data)
    except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
        raise ValueError(f"the stored {kind} cannot be rebuilt: {exc}") from exc


def _loads(decoder: json.JSONDecoder) -> Callable[[str], Any]:
    """``decoder.decode``, by its C scanner alone for a text that is exactly one JSON value
    (what `JSONCodec.encode` writes): ``decode`` itself is Python around that scanner, with a
    regular expression on each side. Any other text (whitespace around the value, extra data,
    nothing to parse) goes through ``decode``, which reads it or raises its own error; a
    malformed value raises the scanner's error, which is also the one ``decode`` raises."""
    make_scanner = getattr(json.scanner, "c_make_scanner", None)
    if make_scanner is None:
        return decoder.decode
    scan = make_scanner(decoder)

    def loads(text: str) -> Any:
        try:
            value, end = scan(text, 0)
        except StopIteration:  # no value at 0: a leading space, or no JSON at all
            return decoder.decode(text)
        return value if end == len(text) else decoder.decode(text)

    return loads


_LOADS = _loads(json.JSONDecoder(object_hook=_untagged))
_PLAIN_LOADS = _loads(json.JSONDecoder())


def _check_annotation(annotation: Any, seen: set[int]) -> None:
    """Raise `TypeError` if *annotation* names a type `JSONCodec` cannot store."""
    if id(annotation) in seen:
        return
    seen.add(id(annotation))
    if annotation in (Any, None, type(None)) or isinstance(annotation, (str, typing.TypeVar)):
        return
    origin = typing.get_origin(annotation)
    if origin is not None:
        if origin is typing.Literal:
            return
        if origin is typing.Annotated:
            _check_annotation(typing.get_args(annotation)[0], seen)
            return
        if origin in _UNSTORABLE_ORIGINS:
            raise TypeError(f"a function returning {annotation!r} cannot be made idempotent")
        for arg in typing.get_args(annotation):
            if arg is not Ellipsis and not isinstance(arg, list):
                _check_annotation(arg, seen)
        return
    if not isinstance(annotation, type):
        return  # a NewType, a typing special form: judged at the first call
    if annotation in _PLAIN_TYPES or annotation in _SIMPLE_ENCODERS:
        return
    if issubclass(annotation, enum.Enum) or _is_named_tuple(annotation):
        _class_name(annotation)
        return
    if dataclasses.is_dataclass(annotation):
        _class_name(annotation)
        for hint in typing.get_type_hints(annotation).values():
            _check_annotation(hint, seen)
        return
    if _is_pydantic(annotation):
        _class_name(annotation)
        return
    if typing.is_typeddict(annotation):
        for hint in typing.get_type_hints(annotation).values():
            _check_annotation(hint, seen)
        return
    if annotation in (list, dict, tuple, set, frozenset, object) or issubclass(
        annotation, (Sequence, collections.abc.Mapping)
    ):
        return
    raise TypeError(
        f"a function returning {annotation.__module__}.{annotation.__qualname__} cannot be "
        "made idempotent with the default codec: its results could not be stored"
    )


_PLAIN_TYPES = (str, int, float, bool)
_UNSTORABLE_ORIGINS = (
    type,
    collections.abc.Callable,
    collections.abc.Iterator,
    collections.abc.Generator,
    collections.abc.AsyncIterator,
    collections.abc.AsyncGenerator,
    collections.abc.Awaitable,
    collections.abc.Coroutine,
)


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
        error_args: The exception's arguments (``kind == "error"``).
        reason: Why the value could not be stored (``kind == "unavailable"``).
        error_class: ``module:QualName`` of the exception's class (``kind == "error"``).
        error_attrs: The exception's attributes (``kind == "error"``).
    """

    kind: typing.Literal["value", "error", "unavailable"]
    body: bytes = b""
    error_type: str = ""
    error_args: tuple[Any, ...] = ()
    reason: str = ""
    error_class: str = ""
    error_attrs: dict[str, Any] = dataclasses.field(default_factory=dict)


def encode_value(body: bytes) -> bytes:
    """Frame a codec's bytes as a stored value outcome."""
    return _MAGIC + _VALUE + body


def encode_error(exc: BaseException) -> bytes:
    """Frame a final exception as data: its class, its arguments and its attributes.

    Arguments and attributes are stored with `JSONCodec`'s types; one that cannot be stored is
    kept as its ``str``.
    """
    cls = type(exc)
    payload = {
        "type": qualified_name(cls),
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "args": [_storable(arg) for arg in exc.args],
        "attrs": {
            name: _storable(value)
            for name, value in getattr(exc, "__dict__", {}).items()
            if not name.startswith("__")
        },
    }
    return _MAGIC + _ERROR + _dumps(payload).encode()


def _storable(value: Any) -> Any:
    try:
        return _tagged(value)
    except (TypeError, ValueError):
        return str(value)


def rebuild_error(outcome: Outcome, final: tuple[type[BaseException], ...]) -> BaseException | None:
    """The stored final error as its own class, if that class is one of *final* or a subclass.

    Returns ``None`` when the stored class is not (or no longer) a declared final error.
    """
    cls = _find_class(outcome.error_class) if outcome.error_class else None
    if not (isinstance(cls, type) and issubclass(cls, final)):
        named = [c for c in final if qualified_name(c) == outcome.error_type]
        if not named:
            return None
        cls = named[0]
    try:
        error = cls(*outcome.error_args)
    except Exception:
        error = cls.__new__(cls)
        error.args = outcome.error_args
    for name, value in outcome.error_attrs.items():
        with contextlib.suppress(AttributeError, TypeError):  # read-only: the arguments set it
            setattr(error, name, value)
    return error


def encode_unavailable(reason: str) -> bytes:
    """Frame the marker of a result that ran but could not be serialised."""
    return _MAGIC + _UNAVAILABLE + json.dumps({"reason": reason}).encode()


def qualified_name(cls: type) -> str:
    """Return ``module.QualName`` of *cls*, the name stored for final errors."""
    return f"{cls.__module__}.{cls.__qualname__}"


_VALUE_HEADER = _MAGIC + _VALUE


def value_body(data: bytes | None) -> bytes | None:
    """The codec's bytes of a stored value outcome (what `decode_outcome` finds as its
    ``body``), or ``None`` for any other outcome, to be read with `decode_outcome`."""
    if type(data) is bytes and data.startswith(_VALUE_HEADER) and len(data) > len(_MAGIC):
        return data[len(_VALUE_HEADER) :]
    return None


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
        payload = _LOADS(rest.decode())
        if kind == _ERROR:
            return Outcome(
                "error",
                error_type=str(payload["type"]),
                error_args=tuple(payload["args"]),
                error_class=str(payload.get("class", "")),
                error_attrs=dict(payload.get("attrs", {})),
            )
        if kind == _UNAVAILABLE:
            return Outcome("unavailable", reason=str(payload["reason"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the stored outcome cannot be decoded: {exc}") from exc
    raise ValueError(f"unknown outcome kind {kind!r}")
