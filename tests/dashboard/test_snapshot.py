"""The dashboard's snapshot: pure counting over records, and the WSGI app around it."""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely import Record, Status
from oncely.dashboard import Dashboard
from oncely.dashboard._snapshot import MINUTE_MS, Snapshot
from oncely.testing import FrozenClock

NOW = 28_333_334 * 60_000 + 40_000  # 40 s into a minute
TOKEN = "t0ken-of-sixteen-chars"


def record(key: str, status: Status, **times: int) -> Record:
    fields: dict[str, Any] = {
        "token": 1,
        "attempt": 1,
        "lease_expires_at_ms": NOW + 30_000,
        "expires_at_ms": NOW + 3_600_000,
        "created_at_ms": NOW - 1_000,
        "updated_at_ms": NOW - 500,
    }
    fields.update(times)
    return Record(key=key, status=status, fingerprint="fp", **fields)


def test_records_are_counted_by_status_scope_and_minute() -> None:
    snapshot = Snapshot(NOW, minutes=10)
    snapshot.add(record("orders|a", Status.COMPLETED))
    snapshot.add(record("orders|b", Status.IN_PROGRESS, created_at_ms=NOW - 3 * MINUTE_MS))
    snapshot.add(record("pay|c", Status.FAILED, attempt=3, updated_at_ms=NOW - MINUTE_MS))
    snapshot.add(record("old|d", Status.COMPLETED, created_at_ms=NOW - 60 * MINUTE_MS))
    snapshot.add(record("bare", Status.RELEASED))
    data = snapshot.as_json()
    assert data["by_status"] == {"in_progress": 1, "completed": 2, "failed": 1, "released": 1}
    assert data["by_scope"][0] == {"scope": "orders", "total": 2, "completed": 1, "in_progress": 1}
    assert {row["scope"] for row in data["by_scope"]} == {"orders", "pay", "old", "(unscoped)"}
    series = data["series"]
    assert series["first_minute_ms"] == (NOW // MINUTE_MS - 9) * MINUTE_MS
    assert series["started"][-1] == 3  # a, c and bare began this minute
    assert series["started"][-4] == 1  # b, three minutes ago; d is older than the window
    assert sum(series["started"]) == 4
    assert series["finished"][-1] == 2  # a now, d now; c a minute ago
    assert series["finished"][-2] == 1
    assert series["retried"][-2] == 1


def test_lapsed_leases_are_stuck_and_listed_longest_first_up_to_a_bound() -> None:
    snapshot = Snapshot(NOW, max_listed=2)
    for index, lapsed in enumerate((5_000, 50_000, 500)):
        snapshot.add(record(f"s|{index}", Status.IN_PROGRESS, lease_expires_at_ms=NOW - lapsed))
    snapshot.add(record("s|live", Status.IN_PROGRESS))
    data = snapshot.as_json()
    assert data["stuck_count"] == 3
    assert [lease["lapsed_ms"] for lease in data["stuck"]] == [50_000, 5_000]


def test_a_snapshot_reads_at_most_max_records_and_says_so() -> None:
    snapshot = Snapshot(NOW, max_records=2)
    assert [snapshot.add(record(f"k|{n}", Status.COMPLETED)) for n in range(3)] == [
        True,
        True,
        False,
    ]
    assert snapshot.as_json()["partial"] is True
    assert "oncely_dashboard_partial 1" in snapshot.prometheus()


def test_prometheus_text_is_well_formed() -> None:
    snapshot = Snapshot(NOW)
    snapshot.add(record("k|1", Status.COMPLETED))
    text = snapshot.prometheus({"pending": 4, "dead": 1, "published": 9, "oldest": None})
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[a-z_]+"\})? \d+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    assert 'oncely_records{status="completed"} 1' in text
    assert "oncely_outbox_pending_events 4" in text


# -- the WSGI app ------------------------------------------------------------------------------


def call(
    app: Dashboard, path: str, *, method: str = "GET", **environ: str
) -> tuple[str, dict[str, str], bytes]:
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answer["status"], answer["headers"] = status, dict(headers)

    path, _, query = path.partition("?")
    body = b"".join(
        app(
            {
                "REQUEST_METHOD": method,
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "wsgi.input": io.BytesIO(),
                **environ,
            },
            start_response,
        )
    )
    return answer["status"], answer["headers"], body


@pytest.fixture
def store() -> oncely.Store:
    store = oncely.open_store("memory://", clock=FrozenClock(NOW))
    lease, ttl = timedelta(seconds=30), timedelta(hours=1)
    for n in range(5):
        claimed = store.claim(f"orders|k{n}", "fp", lease=lease, ttl=ttl)
        assert isinstance(claimed, oncely.Acquired)
        if n:
            store.complete(f"orders|k{n}", claimed.token, b"ok", ttl=ttl)
    return store


def test_the_page_its_assets_and_the_data_are_served_with_a_strict_policy(
    store: oncely.Store,
) -> None:
    app = Dashboard(store)
    status, headers, body = call(app, "/")
    assert status == "200 OK"
    assert headers["Content-Security-Policy"].startswith("default-src 'self'")
    assert b'src="/static/dashboard.js"' in body
    assert b"<script>" not in body  # no inline script: the policy forbids it
    for asset in ("/static/dashboard.js", "/static/dashboard.css"):
        assert call(app, asset)[0] == "200 OK"
    status, headers, body = call(app, "/api/snapshot")
    assert headers["Content-Type"] == "application/json"
    data = json.loads(body)
    assert data["records"] == 5
    assert data["by_status"]["completed"] == 4
    assert data["outbox"] is None  # a memory store has no outbox
    status, headers, body = call(app, "/metrics")
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'oncely_records{status="in_progress"} 1' in body
    assert call(app, "/metrics", method="HEAD")[2] == b""


def test_it_is_read_only_and_answers_nothing_else(store: oncely.Store) -> None:
    app = Dashboard(store)
    assert call(app, "/api/snapshot", method="POST")[0] == "405 Method Not Allowed"
    assert call(app, "/../pyproject.toml")[0] == "404 Not Found"
    assert call(app, "/static/index.html")[0] == "404 Not Found"


def test_a_token_is_required_when_given(store: oncely.Store) -> None:
    app = Dashboard(store, token=TOKEN)
    for path in ("/", "/api/snapshot", "/metrics", "/static/dashboard.js"):
        assert call(app, path)[0] == "401 Unauthorized"
    assert call(app, "/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}x")[0] == "401 Unauthorized"
    assert call(app, "/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")[0] == "200 OK"
    assert call(app, "/?token=wrong")[0] == "401 Unauthorized"
    status, headers, _ = call(app, f"/?token={TOKEN}")
    assert status == "303 See Other"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    assert call(app, "/api/snapshot", HTTP_COOKIE=cookie.split(";")[0])[0] == "200 OK"


@pytest.mark.parametrize("token", ["short", 12345, ""])
def test_a_weak_token_is_refused(store: oncely.Store, token: object) -> None:
    with pytest.raises(oncely.ConfigurationError, match="16 characters"):
        Dashboard(store, token=token)  # type: ignore[arg-type]


def test_a_store_without_scan_is_refused() -> None:
    with pytest.raises(oncely.ConfigurationError, match="scan"):
        Dashboard(object())


def test_one_scan_serves_every_viewer_within_the_refresh(store: oncely.Store) -> None:
    scans = []
    real_scan = store.scan  # type: ignore[attr-defined]

    def counting_scan(**kwargs: Any) -> list[Record]:
        scans.append(kwargs)
        return real_scan(**kwargs)  # type: ignore[no-any-return]

    store.scan = counting_scan  # type: ignore[attr-defined]
    app = Dashboard(store, refresh=3600)
    for _ in range(3):
        call(app, "/api/snapshot")
        call(app, "/metrics")
    assert len(scans) == 1
