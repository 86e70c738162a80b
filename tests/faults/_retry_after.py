"""Histories of the httpx transport behind a gateway that answers with hostile ``Retry-After``.

``hostile-retry-after``: the campaign's clients (`tests.faults._http.call`, the ``httpx`` entry
point: `oncely.http.client.IdempotentTransport`) reach the ASGI server through an HTTP proxy of
the history's own, a rate limiter or load balancer in front of it. For each order, the proxy
answers the first requests itself, never forwarding them: 503 with a ``Retry-After`` that is a
digit to `str.isdigit` but to nothing else (``²``), 429 with one that RFC 9110 does not allow
(``1.5``, ``+5``, ...), and 503 asking for a pause of twenty digits of seconds. Then it forwards.

None of these is a valid delay-seconds: the transport must pause as if there were none (or give
the 503 back when the pause does not fit its budget), and the client must still end with the
order's result, run once. A client that raises anything but an HTTP error leaves its order
without a result: the checker's ``unfinished``, whose explanation names the crash.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.faults import _http
from tests.faults._checker import Anomaly, check
from tests.faults._history import History, now

FAULTS = ("hostile-retry-after",)

NOT_DIGITS = ("²", "³", "¹")
"""Digits to `str.isdigit`, not to `float` nor to RFC 9110."""
INVALID = ("1.5", "+5", "-1", "5s", "1e3", "soon", "Fri, 32 Foo 2026 99:99:99 GMT")
"""Neither delay-seconds nor an HTTP date."""
HUGE = "99999999999999999999"
"""Delay-seconds longer than any client's budget."""

_HEADERS = ("content-type", "idempotency-key-status")


def applicable(store: str, entry: str) -> bool:
    """The httpx transport, on the shared ASGI servers of Redis and PostgreSQL."""
    return entry == "httpx" and store in ("redis", "postgres")


class _Gate:
    """Per order, the answers the proxy gives itself before it forwards: ``(status, value)``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lock = threading.Lock()
        self.left: dict[str, list[tuple[int, str]]] = {}
        self.given = 0

    def answer(self, order: str) -> tuple[int, str] | None:
        with self.lock:
            if order not in self.left:
                self.left[order] = [
                    (503, self.rng.choice(NOT_DIGITS)),
                    (429, self.rng.choice(INVALID)),
                    (503, HUGE),
                ]
            if not self.left[order]:
                return None
            self.given += 1
            return self.left[order].pop(0)


def _proxy(upstream: int, gate: _Gate) -> ThreadingHTTPServer:
    import httpx

    forward = httpx.Client(base_url=f"http://127.0.0.1:{upstream}", timeout=30.0)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            order = self.headers["X-Op"].removeprefix("C-").rpartition(".")[0]
            hostile = gate.answer(order)
            if hostile is not None:
                status, value = hostile
                self.send_response(status)
                self.send_header("Retry-After", value)  # latin-1 on the wire, as a server may
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            reply = forward.post(self.path, content=body, headers=headers)
            self.send_response(reply.status_code)
            for name in _HEADERS:
                if name in reply.headers:
                    self.send_header(name, reply.headers[name])
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.forward = forward  # type: ignore[attr-defined]
    return server


def run(plan: Any, services: Any) -> tuple[History, list[Anomaly], list[str]]:
    """Run one history of *plan*; its history, anomalies and the faults injected."""
    keys = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    history = History(plan.name, ttl=60.0, keys=keys, lease=plan.lease)
    lock = threading.Lock()
    gate = _Gate(random.Random(plan.seed))
    proxy = _proxy(services.server("asgi", plan.store, plan.lease), gate)
    serving = threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True)
    serving.start()
    deadline = now() + 4 * plan.lease + 15

    def client(order: str) -> None:
        try:
            _http.call(
                history,
                lock,
                proxy.server_address[1],
                entry="httpx",
                order=order,
                disconnect=False,
                deadline=deadline,
            )
        except Exception as exc:  # the transport crashed: the order is left without a result
            with lock:
                history.add(
                    {
                        "ev": "fail",
                        "op": f"C-{order}.crash",
                        "key": order,
                        "worker": "client",
                        "t": now(),
                        "error": type(exc).__name__,
                        "message": f"{type(exc).__name__}: {exc}"[:200],
                        "crashed": True,
                    }
                )

    threads = [threading.Thread(target=client, args=(key,)) for key in keys]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(0.3)  # the server's last events (a stream's end) are on their way
    finally:
        proxy.shutdown()
        proxy.server_close()
        proxy.forward.close()  # type: ignore[attr-defined]
    with lock:
        events = list(history.events)
    history.events = sorted(events + services.server_events_for(keys), key=lambda e: e["t"])
    rows = services.effects.rows(keys)
    return history, _judge(history, rows), [plan.fault] if gate.given else []


def _judge(history: History, rows: Iterable[Mapping[str, Any]]) -> list[Anomaly]:
    """The usual check; an order left unfinished by a crashed client says so."""
    crashes = {event["key"]: event["message"] for event in history.of("fail") if "crashed" in event}
    return [
        Anomaly(anomaly.kind, anomaly.key, f"{anomaly.explanation}: the client crashed, {crash}")
        if anomaly.kind == "unfinished" and (crash := crashes.get(anomaly.key))
        else anomaly
        for anomaly in check(history, rows)
    ]
