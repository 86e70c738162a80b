"""Result codecs side by side: what each can replay, and what an encode + decode costs.

Not a test. For each candidate engine (oncely's tagged JSON, pydantic's TypeAdapter, msgspec,
cattrs with the stdlib json, and pickle as a floor that oncely must never use) and each sample
result, it checks whether a replay is equal and of the same type, with the return annotation
and without it, and measures encode + decode time per result (interleaved rounds, medians).

    pip install -e '.[pydantic]' msgspec cattrs
    python benchmarks/codec/bench_codec.py                 # writes benchmarks/results/codec.md
    python benchmarks/codec/bench_codec.py --rounds 3 --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import decimal
import enum
import os
import pickle
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pydantic

from oncely import JSONCodec

ROOT = Path(__file__).resolve().parents[2]


class Status(enum.Enum):
    PAID = "paid"
    REFUNDED = "refunded"


class Money(NamedTuple):
    amount: decimal.Decimal
    currency: str


@dataclasses.dataclass(frozen=True)
class Payment:
    id: uuid.UUID
    amount: decimal.Decimal
    at: datetime.datetime
    status: Status
    tags: frozenset[str]


class Order(pydantic.BaseModel):
    id: uuid.UUID
    total: decimal.Decimal
    placed: datetime.datetime
    lines: list[int]


NOW = datetime.datetime(2026, 11, 23, 19, 0, tzinfo=datetime.timezone.utc)
PAYMENT = Payment(uuid.UUID(int=7), decimal.Decimal("12.50"), NOW, Status.PAID, frozenset({"eu"}))

SAMPLES: list[tuple[str, Any, Any]] = [
    ("small JSON dict", {"id": "p-1", "amount": 1250, "ok": True}, dict[str, Any]),
    ("Decimal", decimal.Decimal("12.50"), decimal.Decimal),
    ("dataclass (UUID, Decimal, datetime, enum, frozenset)", PAYMENT, Payment),
    ("named tuple", Money(decimal.Decimal("9.99"), "EUR"), Money),
    (
        "pydantic model",
        Order(id=uuid.UUID(int=1), total=decimal.Decimal("30"), placed=NOW, lines=[1, 2]),
        Order,
    ),
    ("100 dataclasses", [PAYMENT] * 100, list[Payment]),
    ("tuple of int and str", (1, "a"), tuple[int, str]),
]


def same(left: Any, right: Any) -> bool:
    if type(left) is not type(right):
        return False
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(map(same, left, right))
    if isinstance(left, dict):
        return list(left) == list(right) and all(same(left[k], right[k]) for k in left)
    return bool(left == right)


Engine = Callable[[Any, Any], tuple[Callable[[], bytes], Callable[[bytes], Any]] | None]
"""(value, annotation or None) -> (encode, decode), or None if the engine cannot try."""


def oncely_engine(value: Any, annotation: Any) -> Any:
    codec = JSONCodec()
    return lambda: codec.encode(value), lambda data: codec.decode(data, annotation or Any)


def pydantic_engine(value: Any, annotation: Any) -> Any:
    adapter = pydantic.TypeAdapter(annotation or Any)
    return lambda: adapter.dump_json(value), adapter.validate_json


def msgspec_engine(value: Any, annotation: Any) -> Any:
    import msgspec

    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(annotation) if annotation else msgspec.json.Decoder()
    return lambda: encoder.encode(value), decoder.decode


def cattrs_engine(value: Any, annotation: Any) -> Any:
    from cattrs.preconf.json import make_converter

    converter = make_converter()
    kind = annotation or Any
    return (
        lambda: converter.dumps(value, unstructure_as=kind).encode(),
        lambda data: converter.loads(data, kind),
    )


def pickle_engine(value: Any, annotation: Any) -> Any:
    return lambda: pickle.dumps(value, protocol=5), pickle.loads


ENGINES: dict[str, Engine] = {
    "oncely JSONCodec": oncely_engine,
    "pydantic TypeAdapter": pydantic_engine,
    "msgspec": msgspec_engine,
    "cattrs + json": cattrs_engine,
    "pickle (floor; never used)": pickle_engine,
}


def replays(engine: Engine, value: Any, annotation: Any) -> tuple[bool, Any]:
    try:
        pair = engine(value, annotation)
        assert pair is not None
        encode, decode = pair
        return same(decode(encode()), value), pair
    except Exception:
        return False, None


def time_once(pair: Any, loops: int) -> float:
    encode, decode = pair
    started = time.perf_counter()
    for _ in range(loops):
        decode(encode())
    return (time.perf_counter() - started) / loops * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer loops per round")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/codec.md")
    args = parser.parse_args(argv)
    budget = 0.05 if args.quick else 0.2  # seconds per engine, sample and round

    capability: dict[tuple[str, str], tuple[bool, bool]] = {}
    timings: dict[tuple[str, str], list[float]] = {}
    pairs: dict[tuple[str, str], Any] = {}
    for sample, value, annotation in SAMPLES:
        for name, engine in ENGINES.items():
            typed, pair = replays(engine, value, annotation)
            bare, _ = replays(engine, value, None)
            capability[(name, sample)] = (typed, bare)
            if typed:
                pairs[(name, sample)] = pair
                probe = max(time_once(pair, 3), 0.1)
                timings[(name, sample)] = []
                pairs[(name, sample)] = (pair, max(int(budget * 1e6 / probe), 3))
    load = os.getloadavg()[0]
    for _ in range(args.rounds):  # interleaved: every engine and sample once per round
        for key, (pair, loops) in pairs.items():
            timings[key].append(time_once(pair, loops))

    lines = [
        "# Result codecs: what replays equal, and the cost of an encode + decode",
        "",
        f"Generated by `python benchmarks/codec/bench_codec.py --rounds {args.rounds}"
        f"{' --quick' if args.quick else ''}` on {datetime.date.today()} "
        f"({platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load:.2f} at the start). "
        "µs per result, median of interleaved rounds; `typed` = decoded with the function's "
        "return annotation, `bare` = without one (an unannotated function). "
        "A cell without a time did not replay an equal value of the same type.",
        "",
        "| result | " + " | ".join(ENGINES) + " |",
        "|---|" + "---|" * len(ENGINES),
    ]
    for sample, _, _ in SAMPLES:
        cells = []
        for name in ENGINES:
            typed, bare = capability[(name, sample)]
            if not typed:
                cells.append("no")
                continue
            median = statistics.median(timings[(name, sample)])
            cells.append(f"{median:.1f} µs{'' if bare else ' (typed only)'}")
        lines.append(f"| {sample} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
