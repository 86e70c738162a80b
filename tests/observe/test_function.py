"""The decorator and Guard report each outcome as metrics and spans; with nothing installed,
the decorator's call count does not grow."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import oncely
import oncely.observe
from oncely import _events
from oncely.observe import prometheus
from oncely.stores import MemoryStore
from tests.observe.conftest import Sinks

SCOPE = "obs.charge"


def charge_function(store: Any, calls: list[str]) -> Any:
    @oncely.idempotent(store=store, key="payment_id", scope=SCOPE, on_conflict="raise")
    def charge(payment_id: str, cents: int) -> int:
        calls.append(payment_id)
        return cents

    return charge


def test_decorator_outcomes_are_counted_timed_and_spanned(sinks: Sinks) -> None:
    store = oncely.open_store("memory://")
    calls: list[str] = []
    charge = charge_function(store, calls)
    assert charge("p-1", 5) == 5
    assert charge("p-1", 5) == 5  # replayed
    with pytest.raises(oncely.FingerprintMismatchError):
        charge("p-1", 6)
    with pytest.raises(oncely.InvalidKeyError):
        charge("", 5)
    assert calls == ["p-1"]
    labels = {"surface": "function", "operation": SCOPE, "store": "memory"}
    for outcome in ("acquired", "replayed", "mismatch", "refused"):
        assert sinks.prom("oncely_operations_total", **labels, outcome=outcome) == 1, outcome
        assert sinks.otel("oncely.operations", **labels, outcome=outcome) == 1, outcome
    assert sinks.prom("oncely_operation_duration_seconds_count", **labels, outcome="acquired") == 1
    assert sinks.otel("oncely.operation.duration", **labels, outcome="replayed") == 1
    claims = {"db_system_name": "memory", "db_operation_name": "claim"}
    assert sinks.prom("oncely_store_operation_duration_seconds_count", **claims) == 3
    assert (
        sinks.otel(
            "oncely.store.operation.duration",
            **{"db.system.name": "memory", "db.operation.name": "claim"},
        )
        == 3
    )
    spans = sinks.finished(f"oncely {SCOPE}")
    assert [span.attributes["oncely.outcome"] for span in spans] == [
        "acquired",
        "replayed",
        "mismatch",
        "refused",
    ]
    first = spans[0].attributes
    assert first["oncely.fencing_token"] == 1
    assert first["oncely.scope"] == SCOPE
    assert all("p-1" not in str(value) for span in spans for value in span.attributes.values())
    assert spans[0].status.is_ok
    assert not spans[2].status.is_ok


def test_in_progress_and_store_errors(sinks: Sinks) -> None:
    store = oncely.open_store("memory://")
    calls: list[str] = []
    charge = charge_function(store, calls)

    @oncely.idempotent(store=store, key="payment_id", scope=SCOPE, on_conflict="raise")
    def outer(payment_id: str, cents: int) -> int:
        with pytest.raises(oncely.InProgressError):
            charge(payment_id, cents)  # the same key, while this one runs
        return cents

    outer("p-2", 1)
    labels = {"surface": "function", "operation": SCOPE, "store": "memory"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="in_progress") == 1

    class Down:
        backend = "broken"

        def claim(self, *args: Any, **kwargs: Any) -> Any:
            raise oncely.StoreUnavailableError("down", backend="broken")

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    failing = charge_function(Down(), calls)
    with pytest.raises(oncely.StoreUnavailableError):
        failing("p-3", 1)
    assert (
        sinks.prom("oncely_operations_total", **{**labels, "store": "broken"}, outcome="error") == 1
    )
    errors = {"db_system_name": "broken", "db_operation_name": "claim"}
    assert (
        sinks.prom("oncely_store_errors_total", **errors, error_type="StoreUnavailableError") == 1
    )


def test_async_decorator_and_recovered_lease(sinks: Sinks) -> None:
    store = oncely.open_store("memory://")

    @oncely.idempotent(store=store, key="k", scope="obs.async", fingerprint=None)
    async def work(k: str) -> str:
        return k

    assert asyncio.run(work("a")) == "a"
    assert asyncio.run(work("a")) == "a"
    # A lease taken over after it expired: claimed by hand, left to expire.
    from datetime import timedelta

    store.claim("obs.async|b", "", lease=timedelta(milliseconds=1), ttl=timedelta(hours=1))
    import time

    time.sleep(0.01)
    with oncely.observe.outcomes() as seen:
        asyncio.run(work("b"))
    assert [event.outcome for event in seen] == ["recovered"]
    labels = {"surface": "function", "operation": "obs.async", "store": "memory"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="acquired") == 1
    assert sinks.prom("oncely_operations_total", **labels, outcome="replayed") == 1
    assert sinks.prom("oncely_operations_total", **labels, outcome="recovered") == 1


def test_guard_outcomes(sinks: Sinks) -> None:
    store = oncely.open_store("memory://")
    with oncely.Guard(store, "g-1", scope="obs.guard") as guard:
        assert not guard.replayed
        guard.complete(3)
    with oncely.Guard(store, "g-1", scope="obs.guard") as guard:
        assert guard.replayed
    with pytest.raises(oncely.FingerprintMismatchError):  # noqa: SIM117
        with oncely.Guard(store, "g-1", scope="obs.guard", fingerprint="other"):
            pass

    async def in_async() -> None:
        async with oncely.Guard(store, "g-2", scope="obs.guard") as guard:
            await guard.acomplete(1)

    asyncio.run(in_async())
    labels = {"surface": "function", "operation": "obs.guard", "store": "memory"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="acquired") == 2
    assert sinks.prom("oncely_operations_total", **labels, outcome="replayed") == 1
    assert sinks.prom("oncely_operations_total", **labels, outcome="mismatch") == 1
    assert sinks.otel("oncely.operations", **labels, outcome="acquired") == 2
    outcomes = [s.attributes["oncely.outcome"] for s in sinks.finished("oncely obs.guard")]
    assert outcomes == ["acquired", "replayed", "mismatch", "acquired"]


def test_lease_lost_and_heartbeats_are_reported(sinks: Sinks) -> None:
    from datetime import timedelta

    store = oncely.open_store("memory://")
    with pytest.raises(oncely.LeaseLostError):  # noqa: SIM117
        with oncely.Guard(store, "l-1", scope="obs.lost", heartbeat=False) as guard:
            store.release("obs.lost|l-1", guard.token)  # another worker's doing
            store.claim("obs.lost|l-1", "", lease=timedelta(seconds=30), ttl=timedelta(hours=1))
    assert sinks.prom("oncely_lease_lost_total", operation="obs.lost", during="complete") == 1

    @oncely.idempotent(store=store, key="k", scope="obs.beat", lease=0.03)
    def slow(k: str) -> None:
        deadline = 200
        while not any(isinstance(e, oncely.observe.Heartbeat) for e in sinks.events):
            deadline -= 1
            assert deadline, "no heartbeat"
            __import__("time").sleep(0.01)

    slow("x")
    assert sinks.prom("oncely_heartbeats_total", operation="obs.beat", result="ok") >= 1


def test_a_failing_subscriber_is_logged_once_and_breaks_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(event: oncely.observe.Event) -> None:
        raise RuntimeError("subscriber bug")

    unsubscribe = oncely.observe.subscribe(broken)
    try:
        store = oncely.open_store("memory://")
        charge = charge_function(store, [])
        with caplog.at_level(logging.ERROR, logger="oncely.observe"):
            assert charge("s-1", 1) == 1
            assert charge("s-2", 2) == 2
        assert sum("subscriber" in r.getMessage() for r in caplog.records) == 1
    finally:
        unsubscribe()
    assert not _events.on


def test_installing_is_idempotent_and_removable() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    remove = prometheus.install(registry)
    prometheus.install(registry)  # again: no duplicate registration
    store = oncely.open_store("memory://")
    charge_function(store, [])("i-1", 1)
    labels = {"surface": "function", "operation": SCOPE, "store": "memory", "outcome": "acquired"}
    assert registry.get_sample_value("oncely_operations_total", labels) == 1
    remove()
    assert registry.get_sample_value("oncely_operations_total", labels) is None
    assert not _events.on


def test_no_exporter_no_extra_calls() -> None:
    """The call budget with nothing installed is the decorator's own (the flag is read, no
    function is called); installed, the observed path costs calls, and they stop at removal."""
    from benchmarks.stores import hotpath

    assert not _events.on
    before = hotpath.calls_per_call()
    unsubscribe = oncely.observe.subscribe(lambda event: None)
    try:
        during = hotpath.calls_per_call()
    finally:
        unsubscribe()
    after = hotpath.calls_per_call()
    for what in before:
        assert during[what][0] > before[what][0]
        assert after[what][0] == before[what][0]


def test_guard_in_progress_and_store_error(sinks: Sinks) -> None:
    store = oncely.open_store("memory://")
    with oncely.Guard(store, "g-9", scope="obs.guard2") as outer:
        with pytest.raises(oncely.InProgressError):  # noqa: SIM117
            with oncely.Guard(store, "g-9", scope="obs.guard2", on_conflict="raise"):
                pass
        outer.complete(1)

    class Down(MemoryStore):
        def claim(self, *args: Any, **kwargs: Any) -> Any:
            raise oncely.StoreUnavailableError("down", backend="memory")

    with pytest.raises(oncely.StoreUnavailableError):  # noqa: SIM117
        with oncely.Guard(Down(), "g-10", scope="obs.guard2"):
            pass
    outcomes = [event.outcome for event in sinks.operations(operation="obs.guard2")]
    assert outcomes == ["in_progress", "acquired", "error"]


def test_otel_install_is_idempotent_and_removable() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from oncely.observe import otel

    reader = InMemoryMetricReader()
    meter_provider, tracer_provider = MeterProvider([reader]), TracerProvider()
    remove = otel.install(meter_provider, tracer_provider)
    assert otel.install(meter_provider, tracer_provider) == remove  # the same installation
    charge_function(oncely.open_store("memory://"), [])("o-1", 1)
    remove()
    charge_function(oncely.open_store("memory://"), [])("o-2", 1)  # not counted
    assert not _events.on
    assert not _events.injectors
    points = [
        point.value
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "oncely.operations"
        for point in metric.data.data_points
    ]
    assert points == [1]
    meter_provider.shutdown()


def test_importing_the_event_api_loads_no_exporter() -> None:
    import subprocess
    import sys

    code = (
        "import sys, oncely.observe; "
        "print([m for m in ('prometheus_client', 'opentelemetry') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_grafana_dashboard_charts_series_the_exporter_makes() -> None:
    """Every oncely series the shipped Grafana dashboard queries is one this exporter registers
    (or one the `oncely dashboard` page serves itself): no panel stays empty after a rename."""
    import json
    import re
    from importlib.resources import files

    from prometheus_client import CollectorRegistry

    dashboard = json.loads(files("oncely.dashboard").joinpath("grafana.json").read_text())
    queried: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if name == "expr" and isinstance(value, str):
                    queried.update(re.findall(r"\boncely_[a-z_]+", value))
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    registry = CollectorRegistry()
    remove = prometheus.install(registry)
    try:
        registered = set(registry._names_to_collectors)
    finally:
        remove()
    served_by_the_page = {"oncely_records", "oncely_stuck_leases"}
    assert queried, "the dashboard queries no oncely series"
    assert queried - served_by_the_page <= registered


def test_heartbeat_failures_and_a_lease_lost_to_a_heartbeat(sinks: Sinks) -> None:
    from oncely import LeaseLost

    answers: list[Any] = [oncely.StoreUnavailableError("blip", backend="memory")]

    class Flaky(MemoryStore):
        def extend(self, key: str, token: int, *, lease: Any) -> Any:
            answer = answers.pop(0) if answers else LeaseLost()
            if isinstance(answer, Exception):
                raise answer
            return answer

    store = Flaky()

    @oncely.idempotent(store=store, key="k", scope="obs.flaky", lease=0.03)
    def slow(k: str) -> None:
        for _ in range(500):
            if any(isinstance(e, oncely.observe.LeaseLost) for e in sinks.events):
                return
            __import__("time").sleep(0.01)
        raise AssertionError("no lease lost")

    slow("x")  # the store's own record says otherwise: its complete lands
    assert sinks.prom("oncely_heartbeats_total", operation="obs.flaky", result="failed") >= 1
    assert sinks.prom("oncely_lease_lost_total", operation="obs.flaky", during="heartbeat") == 1
    errors = {"db_system_name": "memory", "db_operation_name": "extend"}
    assert (
        sinks.prom("oncely_store_errors_total", **errors, error_type="StoreUnavailableError") == 1
    )
