"""HTTP entry points under faults: an ASGI app (Starlette on uvicorn) and a WSGI app (waitress),
each behind oncely's middleware, and the clients that call them.

The apps' one route, ``POST /pay`` with ``{"order"}`` (and the headers ``X-Op``, ``X-Hold`` and
``X-Pause``, outside the fingerprint), is a protected
handler like the campaign's others: it announces its fencing token to the effects table, writes
the order's effect, and answers ``{"op", "token"}``, streamed in two chunks ``pause`` seconds
apart (a client with a shorter read timeout disconnects in between). The servers run in worker
processes (forkserver) and send their events through a pipe, as `tests.faults._workers` does.

A server given ``kill`` (``mid``: its handler has the lease and runs; ``effect``: the handler's
write stands, nothing is completed yet) SIGKILLs itself in its first request there, between the
middleware's claim and its completion: a uvicorn worker lost mid-request. Its clients retry with
their key on another server of the same app (as a load balancer would send them).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import oncely
from tests.faults._effects import Effects
from tests.faults._history import Event, History, now

Send = Callable[[Event], None]


def _events(pipe: Any, worker: str) -> Callable[..., None]:
    lock = threading.Lock()

    def event(ev: str, op: str, key: str, **fields: Any) -> None:
        with lock:
            pipe.send({"ev": ev, "op": op, "key": key, "worker": worker, "t": now(), **fields})

    return event


def _lease() -> tuple[int, str]:
    lease = oncely.current_lease()
    assert lease is not None
    return lease.token, lease.key


def _chunks(value: dict[str, Any]) -> tuple[bytes, bytes]:
    """The response in two chunks; the first padded past waitress's send buffer (18000 bytes)
    so that it leaves the server before the pause."""
    body = json.dumps(value).encode()
    return b" " * 20000 + body[:5], body[5:]


def serve(kind: str, config: dict[str, Any], pipe: Any) -> None:
    """Serve the app of *kind* (``asgi`` or ``wsgi``) on a loopback port sent through *pipe*
    (``{"ev": "listening", "port"}``); ``config["kill"]``: where the ASGI server dies."""
    from oncely.http import HttpPolicy

    store = oncely.open_store(config["store"]["url"], **config["store"].get("options", {}))
    effects = Effects(config["effects"]["url"], config["effects"]["schema"])
    policy = HttpPolicy(
        lease=timedelta(seconds=config["lease"]), ttl=timedelta(seconds=config["ttl"])
    )
    worker = config.get("worker", kind)
    event = _events(pipe, worker)
    sock = socket.create_server(("127.0.0.1", 0))
    pipe.send({"ev": "listening", "port": sock.getsockname()[1], "worker": worker})
    if kind == "asgi":
        _serve_asgi(store, effects, policy, event, sock, config.get("kill"))
    else:
        _serve_wsgi(store, effects, policy, event, sock)


def _serve_asgi(
    store: Any,
    effects: Effects,
    policy: Any,
    event: Callable[..., None],
    sock: socket.socket,
    kill: str | None = None,
) -> None:
    import psycopg
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from oncely.http.asgi import IdempotencyMiddleware

    running: dict[str, str] = {}  # op -> key: the handlers in flight, who die with the server

    def die(op: str, key: str, point: str) -> None:
        event("fault", op, key, kind=f"kill@{point}", excuses=True)
        for other, its_key in running.items():
            if other != op:
                event("fault", other, its_key, kind=f"kill@{point}", excuses=True, along=True)
        os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()

    async def pay(request: Request) -> StreamingResponse:
        body = await request.json()
        op, key, (token, lease) = request.headers["x-op"], body["order"], _lease()
        hold = float(request.headers["x-hold"])
        pause = float(request.headers["x-pause"])
        event("run", op, key, token=token, lease=lease)
        running[op] = key
        async with await psycopg.AsyncConnection.connect(effects.url, autocommit=True) as conn:
            standing = await effects.abegin(conn, key, token)
            if standing is not None:
                event("adopt", op, key, of=standing[0])
                value = {"op": standing[0], "token": standing[1]}
            else:
                if kill == "mid":
                    die(op, key, "mid")
                await asyncio.sleep(hold)
                accepted = await effects.awrite(conn, key, op, token)
                event("effect", op, key, token=token, accepted=accepted)
                if kill == "effect":
                    die(op, key, "effect")
                value = {"op": op, "token": token}
        running.pop(op, None)
        first, rest = _chunks(value)

        async def stream() -> Any:
            yield first
            await asyncio.sleep(pause)
            yield rest
            event("end", op, key)

        return StreamingResponse(stream(), status_code=201, media_type="application/json")

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    protected = IdempotencyMiddleware(app, store=store, policy=policy)
    config = uvicorn.Config(protected, log_level="error", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


def _serve_wsgi(
    store: Any, effects: Effects, policy: Any, event: Callable[..., None], sock: socket.socket
) -> None:
    import psycopg
    import waitress

    from oncely.http.wsgi import IdempotencyMiddleware

    def app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = json.loads(environ["wsgi.input"].read(length))
        op, key, (token, lease) = environ["HTTP_X_OP"], body["order"], _lease()
        hold = float(environ["HTTP_X_HOLD"])
        pause = float(environ["HTTP_X_PAUSE"])
        event("run", op, key, token=token, lease=lease)
        with psycopg.connect(effects.url, autocommit=True) as conn:
            standing = effects.begin(conn, key, token)
            if standing is not None:
                event("adopt", op, key, of=standing[0])
                value = {"op": standing[0], "token": standing[1]}
            else:
                time.sleep(hold)
                accepted = effects.write(conn, key, op, token)
                event("effect", op, key, token=token, accepted=accepted)
                value = {"op": op, "token": token}
        first, rest = _chunks(value)
        start_response("201 Created", [("Content-Type", "application/json")])

        def stream() -> Iterator[bytes]:
            yield first
            time.sleep(pause)
            yield rest
            event("end", op, key)

        return stream()

    protected = IdempotencyMiddleware(app, store=store, policy=policy)
    waitress.serve(protected, sockets=[sock], threads=8, _quiet=True)


# -- clients --------------------------------------------------------------------------------


def call(
    history: History,
    lock: threading.Lock,
    port: int,
    *,
    entry: str,
    order: str,
    disconnect: bool,
    deadline: float,
    fallback: int | None = None,
) -> None:
    """A client's whole story for one order: call, and retry as a client would until it has
    the result (a new request, so a new key, when the httpx transport gave up on its own).
    Once the server at *port* is gone (the connection failed), retries go to *fallback*."""
    import httpx

    from oncely.http.client import IdempotentTransport

    def record(ev: str, op: str, **fields: Any) -> None:
        with lock:
            event = {"ev": ev, "op": op, "key": order, "worker": "client", "t": now()}
            history.add({**event, **fields})

    key = str(uuid.uuid4())
    pause = 1.0 if disconnect else 0.0
    for attempt in range(1, 100):
        op = f"C-{order}.{attempt}"
        headers = {"X-Op": op, "X-Hold": "0.02", "X-Pause": str(pause if attempt == 1 else 0.0)}
        record("invoke", op)
        try:
            if entry == "httpx":
                transport = IdempotentTransport(
                    httpx.HTTPTransport(), max_attempts=6, backoff=0.1, seed=attempt
                )
                with httpx.Client(transport=transport, timeout=0.4) as client:
                    reply = client.post(
                        f"http://127.0.0.1:{port}/pay", json={"order": order}, headers=headers
                    )
            else:
                with httpx.Client(timeout=0.4 if attempt == 1 else 5.0) as client:
                    reply = client.post(
                        f"http://127.0.0.1:{port}/pay",
                        json={"order": order},
                        headers={**headers, "Idempotency-Key": key},
                    )
        except Exception as exc:
            if type(exc).__name__ != "OutcomeUnknownError":
                if not isinstance(exc, httpx.HTTPError):
                    raise
                if isinstance(exc, httpx.TimeoutException):
                    record("fail", op, error="ReadTimeout", message=str(exc)[:200])
                else:
                    message = f"{type(exc).__name__}: {exc}"[:200]
                    record("fail", op, error="killed", message=message)
                    port = fallback or port
            else:  # the transport knows the request may have run: a new key could run it twice
                record("fail", op, error="OutcomeUnknownError", message=str(exc)[:200])
                return
        else:
            if reply.status_code == 201:
                record("ok", op, value=reply.json())
                if entry == "httpx" or attempt > 1:
                    return
            elif reply.status_code == 500 and "response-not-stored" in reply.text:
                record("fail", op, error="ResultUnavailableError", message=reply.text[:200])
                return  # it ran, and will never run again: its answer is not replayable
            else:
                status = reply.status_code
                record("fail", op, error="InProgressError" if status == 409 else str(status))
        if now() > deadline:
            return
        time.sleep(0.2)
