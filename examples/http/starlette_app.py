"""A Starlette payments API protected by oncely's ASGI middleware.

Run it: ``python examples/http/starlette_app.py --port 8000`` (needs starlette and uvicorn),
then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

``POST /transfers`` requires a key and ``POST /webhooks`` stays up when the store is down, both
set on the endpoint with `idempotent_route`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from _payments import (
    Ledger,
    SimulatedFailure,
    Simulation,
    adjustment,
    main,
    parse_payment,
    payment_headers,
)
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

import oncely
from oncely.http import HttpPolicy, idempotent_route
from oncely.http.asgi import IdempotencyMiddleware


def create_app(
    store: oncely.AsyncStore, ledger: Ledger, policy: HttpPolicy | None = None
) -> Starlette:
    """The payments API, with the middleware installed."""

    async def create_payment(request: Request) -> Response:
        simulation = Simulation.from_query(request.query_params)
        payment = parse_payment(await request.body(), request.headers.get("content-type", ""))
        if payment is None:
            return JSONResponse({"error": "the body is not a payment object"}, status_code=400)
        await asyncio.sleep(simulation.delay)
        charged = ledger.charge(payment)
        if simulation.fail == "raise":
            raise SimulatedFailure("the handler failed after charging")
        status = simulation.status
        content = simulation.body(charged)
        headers = dict(payment_headers(charged["id"]))
        if simulation.chunks == 1:
            return Response(content, status, headers, media_type="application/json")

        async def pieces() -> AsyncIterator[bytes]:
            for piece in simulation.pieces(content):
                yield piece

        headers["content-length"] = str(len(content))
        return StreamingResponse(pieces(), status, headers, media_type="application/json")

    @idempotent_route(require_key=True)
    async def create_transfer(request: Request) -> Response:
        return await create_payment(request)

    @idempotent_route(fail_open=True)
    async def receive_webhook(request: Request) -> Response:
        return await create_payment(request)

    async def payment(request: Request) -> Response:
        if request.method == "PUT":
            return JSONResponse(ledger.charge(adjustment(await request.body())))
        found = ledger.get(request.path_params["payment_id"])
        return JSONResponse(found or {"error": "not found"}, status_code=200 if found else 404)

    return Starlette(
        routes=[
            Route("/payments", create_payment, methods=["POST"]),
            Route("/payments/{payment_id:int}", payment, methods=["GET", "PUT"]),
            Route("/transfers", create_transfer, methods=["POST"]),
            # A mounted sub-app: its decorated endpoint is found all the same.
            Mount("/", routes=[Route("/webhooks", receive_webhook, methods=["POST"])]),
        ],
        middleware=[Middleware(IdempotencyMiddleware, store=store, policy=policy)],
    )


if __name__ == "__main__":
    main("asgi", create_app, __doc__.splitlines()[0])
