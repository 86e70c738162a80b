"""A small read-only dashboard of a store: ``oncely dashboard --store URL``.

It shows records by status and scope, the leases that lapsed without a settle, first claims,
completions and retried records per minute over the last hours, replays and duplicates per
minute with the recent mismatches and refusals (what the app's processes record with
`oncely.observe.record_activity`), and the outbox's backlog when the store has one;
``/metrics`` serves the same figures as Prometheus text. Everything the page
loads is served by oncely (no build step, nothing from a CDN). It binds to loopback by default;
give a token to require one.

The app is plain WSGI (`Dashboard`), so it can also be mounted in an existing app; `serve` runs it
on the standard library's server, which is all a page for operators needs.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from oncely._core.records import Record
from oncely.dashboard._snapshot import Snapshot, activity_gauges
from oncely.errors import ConfigurationError
from oncely.observe.activity import MemorySink, Sink, read_sink, sink_for

__all__ = ["Dashboard", "serve"]

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
_COOKIE = "oncely_dashboard"
_HEADERS = [
    ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
]

StartResponse = Callable[..., Any]


def _records(store: Any, page: int = 1000) -> Iterator[Record]:
    after = ""
    while True:
        records: list[Record] = store.scan(after=after, limit=page)
        yield from records
        if len(records) < page:
            return
        after = records[-1].key


class Dashboard:
    """The dashboard of *store* as a WSGI app.

    Args:
        store: An open store with ``scan`` (every store oncely ships has one).
        token: When given, every request must carry it: ``Authorization: Bearer <token>``, or
            the cookie that opening ``/?token=<token>`` once sets.
        minutes: How many minutes of activity the charts show.
        refresh: Seconds a snapshot is reused, so many viewers cost one scan.
        max_records: Records read per snapshot at most (the page says when it read only part).
        recent: Recent mismatches and refusals listed at most.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: Any,
        *,
        token: str | None = None,
        minutes: int = 180,
        refresh: float = 5.0,
        max_records: int = 100_000,
        recent: int = 50,
    ) -> None:
        if not callable(getattr(store, "scan", None)):
            raise ConfigurationError(f"the dashboard needs a store with scan(), not {store!r}")
        if token is not None and (not isinstance(token, str) or len(token) < 16):
            raise ConfigurationError("a dashboard token must be a string of 16 characters or more")
        self.store = store
        self.token = token
        self.minutes = minutes
        self.refresh = refresh
        self.max_records = max_records
        self.recent = recent
        self._lock = threading.Lock()
        self._cached: tuple[float, Snapshot, dict[str, Any] | None, dict[str, Any]] | None = None
        self._sink: Sink | None = None
        files = resources.files("oncely.dashboard") / "static"
        self._static = {
            path: ((files / name).read_bytes(), kind) for path, (name, kind) in _STATIC.items()
        }

    # -- data ----------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        clock = getattr(self.store, "clock", None)
        now = getattr(clock, "now_ms", None)
        return int(now()) if callable(now) else time.time_ns() // 1_000_000

    def _outbox(self) -> dict[str, Any] | None:
        if getattr(self.store, "backend", None) not in ("postgres", "sqlite"):
            return None
        from oncely.outbox._relay import backend_stats

        try:
            return {key: _plain(value) for key, value in backend_stats(self.store).items()}
        except Exception as exc:  # no outbox table yet, or the store is away: say so
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _activity(self) -> dict[str, Any]:
        """Every process's recorded activity (times are the recording processes' clocks)."""
        try:
            if self._sink is None:
                self._sink = sink_for(self.store)
            activity = read_sink(self._sink, minutes=self.minutes, recent=self.recent)
        except Exception as exc:  # the store is away, or keeps no activity: say so
            if self._sink is not None and not isinstance(self._sink, MemorySink):
                self._sink.close()  # reconnect on the next read
            self._sink = None
            return {"error": f"{type(exc).__name__}: {exc}"}
        return activity.as_json()

    def snapshot(self) -> tuple[Snapshot, dict[str, Any] | None]:
        """The current snapshot and outbox counts (reused for `refresh` seconds)."""
        snapshot, outbox, _ = self.view()
        return snapshot, outbox

    def view(self) -> tuple[Snapshot, dict[str, Any] | None, dict[str, Any]]:
        """The current snapshot, outbox counts and activity (reused for `refresh` seconds)."""
        with self._lock:
            cached = self._cached
            if cached is not None and time.monotonic() - cached[0] < self.refresh:
                return cached[1], cached[2], cached[3]
            snapshot = Snapshot(self._now_ms(), self.minutes, self.max_records)
            for record in _records(self.store):
                if not snapshot.add(record):
                    break
            outbox = self._outbox()
            activity = self._activity()
            self._cached = (time.monotonic(), snapshot, outbox, activity)
            return snapshot, outbox, activity

    def close(self) -> None:
        """Let go of the activity reader's connection (the store stays open)."""
        with self._lock:
            sink, self._sink = self._sink, None
        if sink is not None and not isinstance(sink, MemorySink):
            sink.close()

    # -- WSGI ----------------------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/") or "/"
        if method not in ("GET", "HEAD"):
            return _respond(start_response, "405 Method Not Allowed", b"read-only\n", "text/plain")
        if self.token is not None:
            query = parse_qs(environ.get("QUERY_STRING", ""))
            given = query.get("token", [None])[0]
            if path == "/" and given is not None and hmac.compare_digest(given, self.token):
                cookie = f"{_COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
                start_response("303 See Other", [("Location", "/"), ("Set-Cookie", cookie)])
                return [b""]
            if not self._authorized(environ):
                return _respond(start_response, "401 Unauthorized", b"token needed\n", "text/plain")
        if path in self._static:
            body, kind = self._static[path]
            return _respond(start_response, "200 OK", body, kind, method=method)
        if path == "/api/snapshot":
            snapshot, outbox, activity = self.view()
            body = json.dumps({**snapshot.as_json(outbox), "activity": activity}).encode()
            return _respond(start_response, "200 OK", body, "application/json", method=method)
        if path == "/metrics":
            snapshot, outbox, activity = self.view()
            kind = "text/plain; version=0.0.4; charset=utf-8"
            body = (snapshot.prometheus(outbox) + activity_gauges(activity)).encode()
            return _respond(start_response, "200 OK", body, kind, method=method)
        return _respond(start_response, "404 Not Found", b"not found\n", "text/plain")

    def _authorized(self, environ: dict[str, Any]) -> bool:
        assert self.token is not None
        header = environ.get("HTTP_AUTHORIZATION", "")
        if header.startswith("Bearer ") and hmac.compare_digest(header[7:], self.token):
            return True
        for part in environ.get("HTTP_COOKIE", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == _COOKIE and hmac.compare_digest(value, self.token):
                return True
        return False


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def _respond(
    start_response: StartResponse,
    status: str,
    body: bytes,
    kind: str,
    *,
    method: str = "GET",
) -> list[bytes]:
    headers = [
        ("Content-Type", kind),
        ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"),
        *_HEADERS,
    ]
    start_response(status, headers)
    return [b""] if method == "HEAD" else [body]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(
    store: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    **options: Any,
) -> WSGIServer:
    """Make the dashboard's server for *store* on *host*:*port*; call ``serve_forever()`` on it.

    *options* go to `Dashboard`. Port 0 picks a free port (``server.server_port``).
    """
    app = Dashboard(store, token=token, **options)
    return make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
