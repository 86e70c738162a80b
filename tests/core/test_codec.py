"""The default codec: every common result type replays equal and of the same type."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import json
import math
import typing
import uuid
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

import oncely
from oncely import JSONCodec
from oncely._core.codec import (
    _rebuild,
    decode_outcome,
    encode_unavailable,
    encode_value,
    value_body,
)

CODEC = JSONCodec()


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Point(NamedTuple):
    x: int
    y: decimal.Decimal


@dataclasses.dataclass(frozen=True)
class Charge:
    amount: decimal.Decimal
    at: datetime.datetime
    id: uuid.UUID
    tags: frozenset[str]
    receipt: bytes
    colour: Colour
    derived: int = dataclasses.field(init=False, default=0)


class Refund(pydantic.BaseModel):
    amount: decimal.Decimal
    at: datetime.datetime
    lines: tuple[int, ...]
    nested: Charge | None = None


class Summary(TypedDict):
    total: decimal.Decimal
    count: int


def same(left: Any, right: Any) -> bool:
    """Equal, and of the same type all the way down."""
    if type(left) is not type(right):
        return False
    if isinstance(left, float) and math.isnan(left):
        return math.isnan(right)
    if isinstance(left, decimal.Decimal) and left.is_nan():
        return right.is_nan()
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(map(same, left, right))
    if isinstance(left, dict):
        return list(left) == list(right) and all(same(left[k], right[k]) for k in left)
    if isinstance(left, datetime.datetime):
        return left == right and left.tzinfo == right.tzinfo and left.fold == right.fold
    return bool(left == right)


PARIS = zoneinfo.ZoneInfo("Europe/Paris")
CHARGE = Charge(
    decimal.Decimal("12.50"),
    datetime.datetime(2026, 3, 29, 1, 30, tzinfo=datetime.timezone.utc),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    frozenset({"a", "b"}),
    b"\x00\xffpdf",
    Colour.BLUE,
)

VALUES: list[Any] = [
    decimal.Decimal("0.1"),
    decimal.Decimal("-0"),
    decimal.Decimal("1E+1000000"),
    decimal.Decimal("NaN"),
    datetime.datetime(2026, 11, 23, 19, 0, 0, 123456),
    datetime.datetime(2026, 10, 25, 2, 30, tzinfo=PARIS, fold=1),
    datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=-5))),
    datetime.date(2026, 2, 28),
    datetime.time(23, 59, 59, 999999),
    datetime.timedelta(days=-1, seconds=5, microseconds=7),
    uuid.uuid4(),
    b"",
    b"\x00\x01binary",
    bytearray(b"mutable"),
    Colour.RED,
    Priority.HIGH,
    math.inf,
    -math.inf,
    math.nan,
    0.1,
    (1, "two", (3.0,)),
    {1, 2, 3},
    frozenset({"x"}),
    {1: "one", 2: "two"},
    {(1, 2): "tuple key", None: 0},
    {"$t": "a user key that looks like a tag"},
    collections.OrderedDict(a=1),
    Point(1, decimal.Decimal("2.5")),
    CHARGE,
    Refund(amount=decimal.Decimal("3.10"), at=CHARGE.at, lines=(1, 2), nested=CHARGE),
    Summary(total=decimal.Decimal("9.99"), count=3),
    [CHARGE, {"point": Point(0, decimal.Decimal(0))}, (Priority.LOW,)],
    {"ok": True, "n": None, "list": [], "empty": {}},
    0,
    "",
    None,
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_round_trip_without_annotation(value: Any) -> None:
    if isinstance(value, collections.OrderedDict):
        with pytest.raises(TypeError, match="OrderedDict"):
            CODEC.encode(value)
        return
    assert same(CODEC.decode(CODEC.encode(value), Any), value)


def test_stored_form_is_json_with_tags() -> None:
    document = json.loads(CODEC.encode({"amount": decimal.Decimal("1.50"), "n": 1}))
    assert document == {"amount": {"$t": "decimal", "v": "1.50"}, "n": 1}
    assert CODEC.encode({"a": [1, "x", None]}) == b'{"a":[1,"x",null]}'  # plain JSON stays so


def test_annotation_still_rebuilds_records_written_before_tags() -> None:
    """A dataclass stored by an earlier version as bare fields is rebuilt from the annotation."""
    old = b'{"x":1,"y":"2.5"}'

    @dataclasses.dataclass
    class Old:
        x: int
        y: str

    assert CODEC.decode(old, Old) == Old(1, "2.5")


@pytest.mark.parametrize(
    "stored",
    [
        b'{"$t":"nope","v":1}',
        b'{"$t":"dataclass","c":"os:system","v":{}}',
        b'{"$t":"enum","c":"tests.core.test_codec:Charge","v":1}',
        b'{"$t":"dataclass","c":"never.imported.module:Thing","v":{}}',
        b'{"$t":"bytes","v":"***"}',
        b'{"$t":"decimal"}',
    ],
)
def test_foreign_tags_fail_closed(stored: bytes) -> None:
    """Unknown tags, classes of another kind or not loaded, bad data: an error, never code."""
    with pytest.raises(ValueError):
        CODEC.decode(stored, Any)


def test_nothing_is_imported_to_decode() -> None:
    import sys

    assert "xml.dom.minidom" not in sys.modules or pytest.skip("already imported here")
    with pytest.raises(ValueError):
        CODEC.decode(b'{"$t":"dataclass","c":"xml.dom.minidom:Node","v":{}}', Any)
    assert "xml.dom.minidom" not in sys.modules


def test_unstorable_values_are_refused_when_encoding() -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(TypeError, match="module level"):
        CODEC.encode(Local(1))
    with pytest.raises(TypeError, match="cannot be stored"):
        CODEC.encode(object())
    with pytest.raises(TypeError, match="cannot be stored"):
        CODEC.encode(Path("/tmp"))


def test_a_class_defined_again_under_its_name_is_stored_and_rebuilt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A notebook cell or a script run again in one process, a reloaded module: the class
    now under the name is the one stored and rebuilt, not its first definition."""
    import sys
    import types

    module = types.ModuleType("oncely_test_redefined")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    source = "import dataclasses\n@dataclasses.dataclass\nclass Receipt:\n    cents: int\n"
    exec(source, module.__dict__)
    first = CODEC.encode(module.Receipt(500))
    assert CODEC.decode(first, Any) == module.Receipt(500)
    exec(source, module.__dict__)  # defined again
    again = CODEC.encode(module.Receipt(900))
    assert CODEC.decode(again, Any) == module.Receipt(900)
    assert type(CODEC.decode(first, Any)) is module.Receipt  # an earlier record too


@pytest.mark.parametrize(
    "annotation",
    [int, decimal.Decimal, list[Charge], dict[int, Point], Refund | None, Summary, tuple[int, ...]],
)
def test_storable_annotations_pass_the_check(annotation: Any) -> None:
    CODEC.check(annotation)


@pytest.mark.parametrize("annotation", [Path, Iterator[int], type[int], list[Path]])
def test_unstorable_annotations_fail_the_check(annotation: Any) -> None:
    with pytest.raises(TypeError):
        CODEC.check(annotation)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
    st.decimals(allow_nan=False),
    st.datetimes(timezones=st.none() | st.just(datetime.timezone.utc)),
    st.dates(),
    st.times(),
    st.timedeltas(),
    st.uuids(),
    st.sampled_from(list(Colour) + list(Priority)),
)
hashable = st.one_of(st.none(), st.integers(), st.text(), st.uuids(), st.dates())
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(), inner, max_size=4),
        st.dictionaries(hashable, inner, max_size=4),
        st.frozensets(hashable, max_size=4),
        st.sets(hashable, max_size=4),
    ),
    max_leaves=20,
)


@given(documents)
def test_any_nesting_round_trips(value: Any) -> None:
    assert same(CODEC.decode(CODEC.encode(value), Any), value)


@pytest.mark.parametrize("url", ["memory://", "sqlite"])
def test_a_decorated_function_replays_every_type(url: str, tmp_path: Path) -> None:
    """The first call and every replay return equal values of the same types."""
    store = oncely.open_store(f"sqlite:///{tmp_path}/o.db" if url == "sqlite" else url)
    calls = 0

    @oncely.idempotent(store=store, key="key")
    def annotated(key: str) -> list[Any]:
        nonlocal calls
        calls += 1
        return [value for value in VALUES if not isinstance(value, collections.OrderedDict)]

    @oncely.idempotent(store=store, key="key")
    def bare(key: str):  # type: ignore[no-untyped-def]  # no annotation on purpose
        nonlocal calls
        calls += 1
        return {"charge": CHARGE, "when": datetime.date(2026, 1, 2), "n": decimal.Decimal(2)}

    for function in (annotated, bare):
        first = function("k-1")
        again = function("k-1")
        assert same(again, first)
    assert calls == 2
    store.close()


class PaymentDeclined(Exception):
    def __init__(self, reason: str, *, amount: decimal.Decimal) -> None:
        super().__init__(reason)
        self.amount = amount


class CardExpired(PaymentDeclined):
    pass


def test_final_errors_replay_as_their_own_subclass_with_attributes(tmp_path: Path) -> None:
    store = oncely.open_store(f"sqlite:///{tmp_path}/o.db")
    calls = 0

    @oncely.idempotent(store=store, key="key", final_errors=(PaymentDeclined,))
    def charge(key: str) -> None:
        nonlocal calls
        calls += 1
        raise CardExpired("expired 2026-10", amount=decimal.Decimal("12.50"))

    for _ in range(2):
        with pytest.raises(CardExpired) as raised:
            charge("k")
        assert raised.value.args == ("expired 2026-10",)
        assert same(raised.value.amount, decimal.Decimal("12.50"))
    assert calls == 1
    store.close()


@dataclasses.dataclass
class _Point:
    x: int


@pytest.mark.parametrize(
    "annotation",
    [
        dict,
        dict[str, typing.Any],
        list[int],
        typing.Optional[dict[str, int]],  # noqa: UP045 - the typing.Union origin
        int | None,
        typing.Sequence[str],
        _Point,
        list[_Point],
        dict[str, _Point],
        typing.Optional[_Point],  # noqa: UP045
        tuple[int, int],
        set[int],
    ],
)
def test_decoding_skips_only_annotations_that_rebuild_nothing(annotation: typing.Any) -> None:
    def outcome(read: typing.Callable[..., object], *args: object) -> object:
        try:
            return read(*args)
        except TypeError as exc:  # data that does not fit the annotation
            return type(exc)

    for data in (b'{"x": 1}', b"[1, 2]", b'[{"x": 1}]', b'{"a": {"x": 1}}', b"null"):
        assert outcome(CODEC.decode, data, annotation) == outcome(
            _rebuild, json.loads(data), annotation
        )


def test_value_body_is_the_body_decode_outcome_finds() -> None:
    for data in (encode_value(b'{"a":1}'), encode_value(b""), b"oncely1", b"x", None):
        try:
            outcome = decode_outcome(data)
        except ValueError:
            assert value_body(data) is None
            continue
        assert value_body(data) == (outcome.body if outcome.kind == "value" else None)
    assert value_body(encode_unavailable("no")) is None


@pytest.mark.parametrize(
    "stored",
    [b'{"a":1}', b' {"a": 1} ', b"[1,2]\n", b'"x"', b"null", b'{"$t":"tuple","v":[1]}', b"\t7"],
)
def test_decode_reads_what_json_reads(stored: bytes) -> None:
    """The scanner alone reads a value that is the whole text; around spaces, `json` does."""
    expected = json.loads(stored)
    if isinstance(expected, dict) and "$t" in expected:
        expected = (1,)
    assert JSONCodec().decode(stored, Any) == expected


@pytest.mark.parametrize("stored", [b"", b" ", b'{"a":1}x', b"{bad", b"[1,", b'{"a":1} 2'])
def test_decode_refuses_what_json_refuses_with_its_error(stored: bytes) -> None:
    with pytest.raises(json.JSONDecodeError) as expected:
        json.JSONDecoder().decode(stored.decode())
    with pytest.raises(json.JSONDecodeError) as raised:
        JSONCodec().decode(stored, Any)
    assert str(raised.value) == str(expected.value)
