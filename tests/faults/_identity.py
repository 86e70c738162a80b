"""HTTP clients whose identity changes between two attempts, against the ASGI middleware.

The ``identity`` entry point: a uvicorn server (Starlette, oncely's middleware with the default
configuration) and, per order, a client that changes what the middleware sees of it between
its attempts, as real clients do:

- ``refresh``: a bearer token refreshed on every attempt (``<who>-t1``, then ``<who>-t2``...);
- ``jar``: an `httpx.Client` cookie jar: the first attempt has no cookie, the response sets a
  session cookie, the retry sends it back;
- ``analytics``: an analytics cookie that changes on every attempt;
- ``shared``: two principals (``alice``, then ``bob``) send one key with one body; each order
  has its own effect (``<order>@<who>``), so nobody may ever get the other's response.

Each client calls again after its first result (and after a ``disconnect``: its first read
times out between the two chunks of the response), so a middleware that lets a changed
credential pick another record runs the handler twice (``rerun``). A client refused with
``idempotency-key-owned-by-another-principal`` (I1 holds: nothing ran twice) takes a new key
when it is another principal (``shared``), else its story ends there: its operation may have
run and will not run again (`OWNED`, an unknown, final outcome).

`foreign_replays` is the checker's rule for I2: a client acknowledged the result of a run made
for another, authenticated principal (``foreign_replay``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from tests.faults._checker import Anomaly, check
from tests.faults._history import History, now

MODES = ("refresh", "jar", "analytics", "shared")

OWNED = "OwnedByAnotherPrincipal"
"""The client error of a 422 ``idempotency-key-owned-by-another-principal`` (see
`tests.faults._history.UNKNOWN_ERRORS` and ``FINAL_ERRORS``)."""


def _who(authorization: str | None) -> str | None:
    """The principal a bearer token names (``alice-t2`` → ``alice``), as the app verifies it."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or "-t" not in token:
        return None
    return token.rpartition("-t")[0]


def serve(config: dict[str, Any], pipe: Any) -> None:
    """Serve the identity app on a loopback port sent through *pipe* (``listening``)."""
    import psycopg
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    import oncely
    from oncely.http import HttpPolicy
    from oncely.http.asgi import IdempotencyMiddleware
    from tests.faults._effects import Effects

    store = oncely.open_store(config["store"]["url"], **config["store"].get("options", {}))
    effects = Effects(config["effects"]["url"], config["effects"]["schema"])
    policy = HttpPolicy(
        lease=timedelta(seconds=config["lease"]), ttl=timedelta(seconds=config["ttl"])
    )
    lock = threading.Lock()

    def event(ev: str, op: str, key: str, **fields: Any) -> None:
        with lock:
            pipe.send({"ev": ev, "op": op, "key": key, "worker": "S", "t": now(), **fields})

    async def pay(request: Request) -> StreamingResponse:
        body = await request.json()
        who = _who(request.headers.get("authorization"))
        key = body["order"] if who is None else f"{body['order']}@{who}"
        lease = oncely.current_lease()
        assert lease is not None
        op, token = request.headers["x-op"], lease.token
        event("run", op, key, token=token, lease=lease.key, principal=who)
        async with await psycopg.AsyncConnection.connect(effects.url, autocommit=True) as conn:
            standing = await effects.abegin(conn, key, token)
            if standing is not None:
                event("adopt", op, key, of=standing[0])
                value = {"op": standing[0], "token": standing[1]}
            else:
                accepted = await effects.awrite(conn, key, op, token)
                event("effect", op, key, token=token, accepted=accepted)
                value = {"op": op, "token": token}
        data = json.dumps(value).encode()
        first, rest = b" " * 20000 + data[:5], data[5:]
        pause = float(request.headers["x-pause"])

        async def stream() -> Any:
            yield first
            await asyncio.sleep(pause)
            yield rest
            event("end", op, key)

        response = StreamingResponse(stream(), status_code=201, media_type="application/json")
        response.set_cookie("session", uuid.uuid4().hex)  # what a login or a cart would set
        return response

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    sock = socket.create_server(("127.0.0.1", 0))
    pipe.send({"ev": "listening", "port": sock.getsockname()[1], "worker": "S", "t": now()})
    protected = IdempotencyMiddleware(app, store=store, policy=policy)
    uvicorn.Server(uvicorn.Config(protected, log_level="error", lifespan="off")).run(sockets=[sock])


def client(
    history: History,
    lock: threading.Lock,
    port: int,
    *,
    mode: str,
    order: str,
    who: str,
    key: str,
    disconnect: bool,
    deadline: float,
) -> None:
    """One client's story for *order* (its effect key): call, and call again as a client
    would until it has the result, changing its credentials as *mode* says."""
    import httpx

    effect = order if mode in ("jar", "analytics") else f"{order}@{who}"

    def record(ev: str, op: str, **fields: Any) -> None:
        with lock:
            event = {"ev": ev, "op": op, "key": effect, "worker": "client", "t": now()}
            history.add({**event, "principal": None if effect == order else who, **fields})

    jar = httpx.Client(timeout=5.0)  # keeps the cookies every response sets
    got = False
    try:
        for attempt in range(1, 60):
            op = f"C-{effect}.{attempt}"
            headers = {
                "X-Op": op,
                "X-Pause": "1.0" if disconnect and attempt == 1 else "0",
                "Idempotency-Key": key,
            }
            if mode == "refresh":
                headers["Authorization"] = f"Bearer {who}-t{attempt}"
            elif mode == "shared":
                headers["Authorization"] = f"Bearer {who}-t1"
            if mode == "analytics":
                headers["Cookie"] = f"_ga={attempt}"
            timeout = 0.4 if disconnect and attempt == 1 else 5.0
            record("invoke", op)
            try:
                if mode == "jar":
                    reply = jar.post(
                        f"http://127.0.0.1:{port}/pay",
                        json={"order": order},
                        headers=headers,
                        timeout=timeout,
                    )
                else:
                    with httpx.Client(timeout=timeout) as fresh:
                        reply = fresh.post(
                            f"http://127.0.0.1:{port}/pay", json={"order": order}, headers=headers
                        )
            except httpx.TimeoutException as exc:
                record("fail", op, error="ReadTimeout", message=str(exc)[:200])
            else:
                text = reply.text
                if reply.status_code == 201:
                    record("ok", op, value=reply.json())
                    if got:
                        return
                    got = True  # and once more, with the credentials changed
                elif reply.status_code == 500 and "response-not-stored" in text:
                    record("fail", op, error="ResultUnavailableError", message=text[:200])
                    return  # it ran, and never runs again: its answer was cut short
                elif "idempotency-key-owned-by-another-principal" in text:
                    if mode == "shared" and who == "bob":  # another's key: take a new one
                        record("fail", op, error="422")
                        key = str(uuid.uuid4())
                    else:
                        record("fail", op, error=OWNED, message=text[:200])
                        return
                else:
                    error = (
                        "InProgressError" if reply.status_code == 409 else str(reply.status_code)
                    )
                    record("fail", op, error=error, message=text[:200])
            if now() > deadline:
                return
            time.sleep(0.1)
    finally:
        jar.close()


def foreign_replays(history: History) -> list[Anomaly]:
    """I2: every client acknowledged a result of a run made for it, or for nobody."""
    ran_for = {event["op"]: event.get("principal") for event in history.of("run")}
    anomalies = []
    for event in history.of("ok"):
        op = str(event["value"]["op"])
        owner = ran_for.get(op)
        if owner is not None and owner != event.get("principal"):
            anomalies.append(
                Anomaly(
                    "foreign_replay",
                    event["key"],
                    f"{event['op']} ({event.get('principal') or 'anonymous'}) was given the "
                    f"result of {op}, which ran for {owner}",
                )
            )
    return anomalies


def run_history(plan: Any, services: Any) -> Any:
    """One ``identity`` history: a client per order (`MODES` in turn) of the store's identity
    server; ``disconnect`` cuts every client's first read."""
    from tests.faults._campaign import Result

    started = now()
    orders = [f"h{plan.index}-{services.run}-k{n}" for n in range(plan.keys)]
    modes = [MODES[(plan.seed + n) % len(MODES)] for n in range(plan.keys)]
    history = History(plan.name, ttl=60.0, lease=plan.lease)
    lock = threading.Lock()
    port = _server(services, plan)
    deadline = now() + 4 * plan.lease + 15
    disconnect = plan.fault == "disconnect"
    stories: list[Callable[[], None]] = []
    for order, mode in zip(orders, modes, strict=True):
        people = ("alice", "bob") if mode == "shared" else ("alice",)
        if mode in ("jar", "analytics"):
            history.keys.append(order)
        else:
            history.keys += [f"{order}@{who}" for who in people]
        key = str(uuid.uuid4())
        stories.append(_story(history, lock, port, mode, order, people, key, disconnect, deadline))
    threads = [threading.Thread(target=story) for story in stories]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(0.3)  # the server's last events (a stream's end) are on their way
    with lock:
        history.events += services.server_events_for(history.keys)
    history.events.sort(key=lambda event: event["t"])
    rows = services.effects.rows(history.keys)
    anomalies = check(history, rows) + foreign_replays(history)
    faults = [plan.fault] if plan.fault != "none" else []
    return Result(plan, history, anomalies, faults, now() - started)


def _server(services: Any, plan: Any) -> int:
    """The port of the identity server on *plan*'s store, started on first use (it lives as
    long as the campaign's other servers; its events go where theirs do)."""
    return int(services.serve_once("identity", plan, serve))


def _story(
    history: History,
    lock: threading.Lock,
    port: int,
    mode: str,
    order: str,
    people: Sequence[str],
    key: str,
    disconnect: bool,
    deadline: float,
) -> Callable[[], None]:
    """The clients of one order, one after the other (``shared``: Alice, then Bob)."""

    def story() -> None:
        for who in people:
            client(
                history,
                lock,
                port,
                mode=mode,
                order=order,
                who=who,
                key=key,
                disconnect=disconnect and who == people[0],
                deadline=deadline,
            )

    return story
