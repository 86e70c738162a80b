"""Histories at the edges: async callers cancelled mid-call, WSGI request bodies cut short.

``cancel@claim``, ``cancel@run``, ``cancel@complete``: client A's async call (the decorator,
``async with Guard``, a request through the ASGI middleware) is cancelled while its claim's
reply is on the way, while its body runs, or while its completion's reply is on the way. The
store is real; a reply "on the way" is one the store has applied and that arrives late (the
wrapper below holds it). A cancelled call is neither an ``ok`` nor a ``fail``: its event is
``cancelled``, which the checker reads as no claim of its own (a cancelled call leaves no
lease behind), so client B's retry told "in progress" with no run holding the key is a
``phantom_in_progress``.

``short-body``: client A sends half of a request body to the WSGI middleware (wsgiref, which
hands the app a short ``wsgi.input``) and half-closes; client B sends the whole request with
the same key. A handler that ran on fewer bytes than announced is a ``truncated_run``.

Everything runs in the campaign's process (threads, an event loop each): the store and the
effects table are the real servers of the campaign.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import oncely
from tests.faults._checker import Anomaly, check
from tests.faults._history import Event, History, now

CANCELS = ("cancel@claim", "cancel@run", "cancel@complete")
FAULTS = (*CANCELS, "short-body")

_REPLY_DELAY = 0.5
"""How long an applied claim's (completion's) reply takes to arrive, in seconds."""


def applicable(store: str, entry: str, fault: str) -> bool:
    """The few combinations the CI campaign runs for these faults."""
    if fault in CANCELS:
        if entry == "async":
            return store == "redis" or (store == "postgres" and fault == "cancel@claim")
        return entry in ("guard_async", "asgi") and store == "redis" and fault == "cancel@claim"
    return fault == "short-body" and entry == "wsgi" and store == "redis"


def run(plan: Any, services: Any) -> tuple[History, list[Anomaly], list[str]]:
    """Run one edge history of *plan*; its history, anomalies and the faults injected."""
    keys = [f"h{plan.index}-{services.run}-k0"]
    history = History(plan.name, ttl=60.0, keys=keys, lease=plan.lease)
    lock = threading.Lock()
    spec = services.store_spec(plan, None)
    store = oncely.open_store(spec["url"], **spec.get("options", {}))
    if plan.fault == "short-body":
        try:
            injected = _short_body(plan, services, store, history, lock, keys[0])
        finally:
            store.close()
    else:
        injected = asyncio.run(_cancelled(plan, services, store, history, lock, keys[0]))
    rows = services.effects.rows(keys)
    anomalies = check(history, rows) + _truncated(history)
    return history, anomalies, [plan.fault] if injected else []


def _truncated(history: History) -> list[Anomaly]:
    return [
        Anomaly(
            "truncated_run",
            event["key"],
            f"{event['op']} ran on {event['size']} of the {event['declared']} bytes announced",
        )
        for event in history.of("run")
        if event.get("size", 0) < event.get("declared", 0)
    ]


def _emitter(history: History, lock: threading.Lock, worker: str) -> Any:
    def event(ev: str, op: str, key: str, **fields: Any) -> None:
        record: Event = {"ev": ev, "op": op, "key": key, "worker": worker, "t": now(), **fields}
        with lock:
            history.add(record)

    return event


# -- async callers cancelled -------------------------------------------------------------------


class _LateReplies:
    """An async store whose armed claim (completion) is applied at once and answers late;
    ``reached`` is set when it has been applied."""

    def __init__(self, store: Any, point: str) -> None:
        self.store = store
        self.point = point
        self.armed = point in ("claim", "complete")
        self.reached = asyncio.Event()

    async def _late(self, verb: str) -> None:
        if self.armed and self.point == verb:
            self.armed = False
            self.reached.set()
            await asyncio.sleep(_REPLY_DELAY)

    async def aclaim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> Any:
        answer = await self.store.aclaim(key, fingerprint, lease=lease, ttl=ttl)
        await self._late("claim")
        return answer

    async def acomplete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> Any:
        answer = await self.store.acomplete(key, token, result, ttl=ttl)
        await self._late("complete")
        return answer

    async def afail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> Any:
        return await self.store.afail(key, token, error, ttl=ttl)

    async def arelease(self, key: str, token: int) -> Any:
        return await self.store.arelease(key, token)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> Any:
        return await self.store.aextend(key, token, lease=lease)

    async def aget(self, key: str) -> Any:
        return await self.store.aget(key)

    async def aclose(self) -> None:
        await self.store.aclose()


async def _cancelled(
    plan: Any, services: Any, store: Any, history: History, lock: threading.Lock, key: str
) -> bool:
    """A's call is cancelled at the plan's point; B retries until it has a result."""
    import psycopg

    point = plan.fault.partition("@")[2]
    late = _LateReplies(store, point)
    lease = timedelta(seconds=plan.lease)
    ttl = timedelta(seconds=history.ttl)
    effects = services.effects
    conn = await psycopg.AsyncConnection.connect(effects.url, autocommit=True)

    async def body(event: Any, op: str, token: int) -> dict[str, Any]:
        event("run", op, key, token=token)
        try:
            standing = await effects.abegin(conn, key, token)
            if standing is not None:
                event("adopt", op, key, of=standing[0])
                return {"op": standing[0], "token": standing[1]}
            if point == "run" and op.startswith("A"):
                late.reached.set()
                await asyncio.sleep(10 * plan.lease)  # cancelled here
            accepted = await effects.awrite(conn, key, op, token)
            event("effect", op, key, token=token, accepted=accepted)
            return {"op": op, "token": token}
        finally:
            event("end", op, key)

    def caller(worker: str, seen: Any) -> Any:
        event = _emitter(history, lock, worker)
        if plan.entry == "guard_async":

            async def guarded(op: str) -> Any:
                async with oncely.Guard(seen, key, scope="faults", lease=lease, ttl=ttl) as held:
                    if held.replayed:
                        return held.result
                    value = await body(event, op, held.token)
                    await held.acomplete(value)
                    return value

            return event, guarded

        if plan.entry == "asgi":
            return event, _asgi_post(seen, key, body, event, plan.lease, history.ttl)

        @oncely.idempotent(
            store=seen, key="key", scope="faults", fingerprint=None, lease=lease, ttl=ttl
        )
        async def protected(key: str, op: str) -> Any:
            current = oncely.current_lease()
            assert current is not None
            return await body(event, op, current.token)

        return event, lambda op: protected(key, op)

    try:
        event_a, call_a = caller("A", late)
        event_a("invoke", "A-0", key)
        task = asyncio.ensure_future(call_a("A-0"))
        reached = asyncio.ensure_future(late.reached.wait())
        await asyncio.wait((task, reached), return_when=asyncio.FIRST_COMPLETED)
        injected = late.reached.is_set() and not task.done()
        task.cancel()
        reached.cancel()
        try:
            value = await task
        except asyncio.CancelledError:
            event_a("cancelled", "A-0", key)
        except Exception as exc:
            event_a("fail", "A-0", key, error=_error(exc), message=str(exc)[:200])
        else:
            event_a("ok", "A-0", key, value=value)
        event_b, call_b = caller("B", store)
        deadline = now() + 4 * plan.lease + 10
        attempt = 0
        while now() < deadline:
            attempt += 1
            op = f"B-{attempt}"
            event_b("invoke", op, key)
            try:
                value = await call_b(op)
            except Exception as exc:
                event_b("fail", op, key, error=_error(exc), message=str(exc)[:200])
                await asyncio.sleep(0.1)
                continue
            event_b("ok", op, key, value=value)
            break
    finally:
        await conn.close()
        await store.aclose()
    return injected


class _Refused(Exception):
    """An HTTP answer other than 201, named as the exception the decorator would raise."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        names = {409: "InProgressError", 422: "FingerprintMismatchError"}
        self.error = names.get(status, f"HTTP{status}")


def _error(exc: Exception) -> str:
    return exc.error if isinstance(exc, _Refused) else type(exc).__name__


def _asgi_post(store: Any, key: str, body: Any, event: Any, lease: float, ttl: float) -> Any:
    """A POST with *key* through the ASGI middleware, whose app runs *body*."""
    from oncely.http import HttpPolicy
    from oncely.http.asgi import IdempotencyMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        op = dict(scope["headers"])[b"x-op"].decode()
        current = oncely.current_lease()
        assert current is not None
        value = await body(event, op, current.token)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(value).encode()})

    policy = HttpPolicy(lease=lease, ttl=ttl)
    middleware = IdempotencyMiddleware(app, store=store, policy=policy)

    async def post(op: str) -> Any:
        sent: list[dict[str, Any]] = []
        headers = [(b"idempotency-key", key.encode()), (b"x-op", op.encode())]
        scope = {"type": "http", "method": "POST", "path": "/orders", "headers": headers}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": key.encode(), "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        await middleware(scope, receive, send)
        status = int(sent[0]["status"])
        if status != 201:
            raise _Refused(status)
        return json.loads(b"".join(message.get("body", b"") for message in sent[1:]))

    return post


# -- WSGI bodies cut short -------------------------------------------------------------------


def _short_body(
    plan: Any, services: Any, store: Any, history: History, lock: threading.Lock, key: str
) -> bool:
    """A half-closes mid-body on wsgiref; B sends the whole request with the same key."""
    import psycopg

    from oncely.http import HttpPolicy
    from oncely.http.wsgi import IdempotencyMiddleware

    effects = services.effects
    local = threading.local()
    opened: list[Any] = []  # every thread's connection, closed once the server has stopped
    server_event = _emitter(history, lock, "server")

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        op = environ["HTTP_X_OP"]
        current = oncely.current_lease()
        assert current is not None
        token = current.token
        declared = int(environ["HTTP_X_BODY_LENGTH"])
        server_event("run", op, key, token=token, size=len(body), declared=declared)
        try:
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = psycopg.connect(effects.url, autocommit=True)
                opened.append(conn)
            standing = effects.begin(conn, key, token)
            if standing is not None:
                value = {"op": standing[0], "token": standing[1]}
            else:
                accepted = effects.write(conn, key, op, token)
                server_event("effect", op, key, token=token, accepted=accepted)
                value = {"op": op, "token": token}
        finally:
            server_event("end", op, key)
        start_response("201 Created", [("Content-Type", "application/json")])
        return [json.dumps(value).encode()]

    policy = HttpPolicy(lease=plan.lease, ttl=history.ttl)
    middleware = IdempotencyMiddleware(app, store=store, policy=policy)
    payload = f"order={key}&note={'x' * 200}".encode()
    injected = False
    try:
        with _wsgiref(middleware) as port:
            for worker, cut in (("A", True), ("B", False)):
                event = _emitter(history, lock, worker)
                op = f"{worker}-0"
                event("invoke", op, key)
                status, reply = _post(port, key, op, payload, cut)
                injected = injected or cut
                if status == 201:
                    event("ok", op, key, value=json.loads(reply))
                else:
                    event("fail", op, key, error=f"HTTP{status}", message=reply[:200].decode())
    finally:
        for conn in opened:
            conn.close()
    return injected


@contextlib.contextmanager
def _wsgiref(app: Any) -> Iterator[int]:
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def _post(port: int, key: str, op: str, payload: bytes, cut: bool) -> tuple[int, bytes]:
    """POST *payload* with *key*; with *cut*, only half of it, then half-close."""
    head = (
        f"POST /orders HTTP/1.0\r\nHost: 127.0.0.1\r\nIdempotency-Key: {key}\r\n"
        f"X-Op: {op}\r\nX-Body-Length: {len(payload)}\r\n"
        f"Content-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + (payload[: len(payload) // 2] if cut else payload))
        if cut:
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (chunk := sock.recv(65536)):
            reply += chunk
    head_part, _, body = reply.partition(b"\r\n\r\n")
    status = int(head_part.split(b" ", 2)[1]) if head_part else 0
    return status, body
