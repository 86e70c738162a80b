"""A decorated call on ``memory://`` with no exporter, with each, with both, and with the
activity recorder (``oncely.observe.record_activity``).

    PYTHONPATH=src python benchmarks/observe/bench_observe.py --ops 20000

Prints one row per setting: the median microseconds of a first call per key (new) and of a
repeat (replay), sync, over interleaved rounds, and the Python calls of one decorated call
(counted as ``benchmarks/stores/hotpath.py`` counts them). "none" is the product as shipped
when nothing is installed: its call count is the decorator's own (see
``tests/observe/test_function.py``). The OpenTelemetry rows use the SDK with an in-memory
metric reader and no span processor, the Prometheus rows a fresh ``CollectorRegistry``. The
subscriber row is a callback that does nothing (the event stream's own cost); the
activity row counts into a memory store with a flush interval longer than the run: what it
measures is the work on the caller's thread (a flush is one round trip every 10 s, off it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stores import hotpath

import oncely


def install(setting: str) -> Callable[[], None]:
    removers: list[Callable[[], None]] = []
    if setting == "subscriber":  # the event stream's own cost: a callback that does nothing
        from oncely.observe import subscribe

        removers.append(subscribe(lambda event: None))
    if setting == "activity":
        from oncely.observe import record_activity

        removers.append(record_activity(oncely.open_store("memory://"), interval=3600).close)
    if setting in ("prometheus", "both"):
        from prometheus_client import CollectorRegistry

        from oncely.observe import prometheus

        removers.append(prometheus.install(CollectorRegistry()))
    if setting in ("otel", "both"):
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider

        from oncely.observe import otel

        removers.append(otel.install(MeterProvider([InMemoryMetricReader()]), TracerProvider()))

    def remove() -> None:
        for each in removers:
            each()

    return remove


def time_calls(ops: int) -> tuple[float, float]:
    store = oncely.open_store("memory://")

    @oncely.idempotent(store=store, key="payment_id")
    def pay(payment_id: str, amount_cents: int) -> dict[str, Any]:
        return {"payment_id": payment_id, "amount_cents": amount_cents}

    keys = [uuid.uuid4().hex for _ in range(ops)]
    gc.collect()
    started = time.perf_counter()
    for key in keys:
        pay(key, 100)
    new = time.perf_counter() - started
    started = time.perf_counter()
    for key in keys:
        pay(key, 100)
    replay = time.perf_counter() - started
    return new / ops * 1e6, replay / ops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    settings = ["none", "subscriber", "activity", "prometheus", "otel", "both"]
    timings: dict[str, list[tuple[float, float]]] = {setting: [] for setting in settings}
    calls: dict[str, tuple[int, int]] = {}
    for round_ in range(options.rounds):
        for setting in settings[round_ % len(settings) :] + settings[: round_ % len(settings)]:
            remove = install(setting)
            try:
                timings[setting].append(time_calls(options.ops))
                if setting not in calls:
                    counted = hotpath.calls_per_call()
                    calls[setting] = (counted["sync new"][0], counted["sync replay"][0])
            finally:
                remove()
    print("| exporters | new key (µs) | replay (µs) | calls: new | calls: replay |")
    print("|---|---|---|---|---|")
    for setting in settings:
        new = statistics.median(t[0] for t in timings[setting])
        replay = statistics.median(t[1] for t in timings[setting])
        print(
            f"| {setting} | {new:.1f} | {replay:.1f} | {calls[setting][0]} | {calls[setting][1]} |"
        )


if __name__ == "__main__":
    main()
