"""The dashboard's replays, duplicates and recent refusals: read back from what the app's
processes recorded (`oncely.observe.record_activity`), in ``/api/snapshot`` and ``/metrics``."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest

import oncely
import oncely.dashboard
from oncely.dashboard import Dashboard
from oncely.dashboard._snapshot import activity_gauges
from oncely.observe import record_activity
from oncely.observe.activity import MINUTE_MS, activity_of
from tests.dashboard.test_snapshot import call

NOW = 1_800_000_000_000 + 30_000


def test_activity_gauges_are_well_formed_and_read_the_last_complete_minute() -> None:
    minute = NOW // MINUTE_MS
    rows = [
        (minute - 1, "pay", "replayed", 7),
        (minute, "pay", "replayed", 2),  # the current minute: not complete yet
        (minute - 5, "orders", "duplicate", 3),
        (minute - 1, "pay", "refused", 1),
    ]
    text = activity_gauges(activity_of(rows, [], now_ms=NOW, minutes=10).as_json())
    sample = re.compile(r'^[a-z_]+\{kind="[a-z_]+"\} \d+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    assert 'oncely_activity_last_minute_operations{kind="replayed"} 7' in text
    assert 'oncely_activity_last_minute_operations{kind="refused"} 1' in text
    assert 'oncely_activity_window_operations{kind="replayed"} 9' in text
    assert 'oncely_activity_window_operations{kind="duplicate"} 3' in text
    assert activity_gauges({"error": "StoreUnavailableError: away"}).startswith("# ")


def test_the_snapshot_and_metrics_carry_every_recorded_replay_and_refusal() -> None:
    store = oncely.open_store("memory://")

    @oncely.idempotent(store=store, key="order", scope="ship", ttl=timedelta(hours=1))
    def ship(order: str) -> str:
        return order

    with record_activity(store, interval=60):
        for n in range(6):
            ship(str(n // 3))  # 4 replays
        with pytest.raises(oncely.InvalidKeyError):
            ship("")
    app = Dashboard(store, minutes=30)
    data = json.loads(call(app, "/api/snapshot")[2])
    activity = data["activity"]
    assert len(activity["replayed"]) == 30
    assert activity["totals"] == {
        "replayed": 4,
        "duplicate": 0,
        "in_progress": 0,
        "mismatch": 0,
        "refused": 1,
    }
    assert [(e["scope"], e["kind"], e["reason"]) for e in activity["recent"]] == [
        ("ship", "refused", "InvalidKeyError")
    ]
    metrics = call(app, "/metrics")[2].decode()
    assert 'oncely_activity_window_operations{kind="replayed"} 4' in metrics
    app.close()


def test_activity_that_cannot_be_read_is_reported_and_the_rest_still_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def away(store: Any) -> Any:
        raise oncely.StoreUnavailableError("the store is away", backend="redis")

    monkeypatch.setattr(oncely.dashboard, "sink_for", away)
    app = Dashboard(oncely.open_store("memory://"))
    status, _, body = call(app, "/api/snapshot")
    data = json.loads(body)
    assert status == "200 OK"
    assert data["activity"]["error"].startswith("StoreUnavailableError")
    assert data["records"] == 0
    assert call(app, "/metrics")[0] == "200 OK"


@pytest.mark.parametrize("backend", ["postgres", "redis"])
def test_the_dashboard_reads_a_network_stores_activity_on_one_kept_connection(
    backend: str,
) -> None:
    import uuid

    from tests.conftest import service_url

    name = f"oncely_dash_{uuid.uuid4().hex[:10]}"
    if backend == "postgres":
        url = service_url("ONCELY_TEST_POSTGRES_URL")
        store = oncely.open_store(url, schema=name)
        store.migrate()  # type: ignore[attr-defined]
    else:
        store = oncely.open_store(service_url("ONCELY_TEST_REDIS_URL"), namespace=name)
    records = oncely.open_store("memory://")

    @oncely.idempotent(store=records, key="order", scope="ship", ttl=timedelta(hours=1))
    def ship(order: str) -> str:
        return order

    app = Dashboard(store, minutes=10, refresh=0)
    try:
        with record_activity(store, interval=60) as recorder:
            ship("a")
            ship("a")
            assert recorder.flush()
            first = json.loads(call(app, "/api/snapshot")[2])["activity"]
            ship("a")
        second = json.loads(call(app, "/api/snapshot")[2])["activity"]
        assert (first["totals"]["replayed"], second["totals"]["replayed"]) == (1, 2)
        assert second["by_scope"] == [{"scope": "ship", "replayed": 2}]
    finally:
        app.close()
        if backend == "postgres":
            import psycopg

            with psycopg.connect(service_url("ONCELY_TEST_POSTGRES_URL"), autocommit=True) as c:
                store.close()
                c.execute(f'DROP SCHEMA "{name}" CASCADE')
        else:
            store.close()
