"""A payments API as a bare ASGI app (no framework), protected by oncely's ASGI middleware.

Run it: ``python examples/http/asgi_app.py --port 8000`` (needs uvicorn), then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

Per-route settings are given by path pattern, since a bare app has no views to decorate.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qsl

from _payments import (
    Ledger,
    SimulatedFailure,
    Simulation,
    adjustment,
    main,
    parse_payment,
    payment_headers,
)

import oncely
from oncely.http import HttpPolicy, RouteOptions
from oncely.http.asgi import IdempotencyMiddleware


def create_app(store: oncely.AsyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Any:
    """The protected app: POST /payments, /transfers (key required), /webhooks (fail-open)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "POST" and path in ("/payments", "/transfers", "/webhooks"):
            await create_payment(scope, receive, send)
        elif path.startswith("/payments/") and method == "GET":
            payment = ledger.get(int(path.rsplit("/", 1)[1]))
            await respond(send, 200 if payment else 404, payment or {"error": "not found"})
        elif path.startswith("/payments/") and method == "PUT":
            await respond(send, 200, ledger.charge(adjustment(await read_body(receive))))
        else:
            await respond(send, 404, {"error": "not found"})

    async def create_payment(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        query = dict(parse_qsl(scope["query_string"].decode()))
        simulation = Simulation.from_query(query)
        headers = {name.decode(): value.decode() for name, value in scope["headers"]}
        payment = parse_payment(body, headers.get("content-type", ""))
        if payment is None:
            await respond(send, 400, {"error": "the body is not a payment object"})
            return
        await asyncio.sleep(simulation.delay)
        charged = ledger.charge(payment)
        if simulation.fail == "raise":
            raise SimulatedFailure("the handler failed after charging")
        status = simulation.status
        content = simulation.body(charged)
        response_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            *((name.encode(), value.encode()) for name, value in payment_headers(charged["id"])),
        ]
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        pieces = simulation.pieces(content)
        for number, piece in enumerate(pieces, start=1):
            await send(
                {"type": "http.response.body", "body": piece, "more_body": number < len(pieces)}
            )

    return IdempotencyMiddleware(
        app,
        store=store,
        policy=policy,
        routes={
            "POST /transfers": RouteOptions(require_key=True),
            "POST /webhooks": RouteOptions(fail_open=True),
        },
    )


async def read_body(receive: Any) -> bytes:
    """Read the whole request body, chunk by chunk."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def respond(send: Any, status: int, document: dict[str, Any]) -> None:
    """Send a small JSON response."""
    body = json.dumps(document).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    main("asgi", create_app, __doc__.splitlines()[0])
