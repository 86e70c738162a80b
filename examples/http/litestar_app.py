"""A Litestar payments API protected by oncely's ASGI middleware.

Run it: ``python examples/http/litestar_app.py --port 8000`` (needs litestar and uvicorn), then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

Litestar routes before its middleware runs, so per-route settings can sit on the handler with
`idempotent_route`, or in the handler's ``opt`` under ``"idempotency"``.
"""

from __future__ import annotations

import asyncio

from _payments import Ledger, SimulatedFailure, Simulation, main, parse_payment, payment_headers
from litestar import Litestar, Request, Response, post
from litestar.middleware import DefineMiddleware

import oncely
from oncely.http import HttpPolicy, RouteOptions, idempotent_route
from oncely.http.asgi import IdempotencyMiddleware


def create_app(
    store: oncely.AsyncStore, ledger: Ledger, policy: HttpPolicy | None = None
) -> Litestar:
    """The payments API, with the middleware defined for every route."""

    async def charge(request: Request) -> Response[bytes]:  # type: ignore[type-arg]
        simulation = Simulation.from_query(request.query_params)
        payment = parse_payment(await request.body(), request.headers.get("content-type", ""))
        if payment is None:
            return Response(
                b'{"error": "not a payment"}', status_code=400, media_type="application/json"
            )
        await asyncio.sleep(simulation.delay)
        charged = ledger.charge(payment)
        if simulation.fail == "raise":
            raise SimulatedFailure("the handler failed after charging")
        return Response(
            simulation.body(charged),
            status_code=500 if simulation.fail == "500" else 201,
            headers=dict(payment_headers(charged["id"])),
            media_type="application/json",
        )

    @post("/payments")
    async def create_payment(request: Request) -> Response[bytes]:  # type: ignore[type-arg]
        return await charge(request)

    @post("/transfers")
    @idempotent_route(require_key=True)
    async def create_transfer(request: Request) -> Response[bytes]:  # type: ignore[type-arg]
        return await charge(request)

    @post("/webhooks", opt={"idempotency": RouteOptions(fail_open=True)})
    async def receive_webhook(request: Request) -> Response[bytes]:  # type: ignore[type-arg]
        return await charge(request)

    return Litestar(
        [create_payment, create_transfer, receive_webhook],
        middleware=[DefineMiddleware(IdempotencyMiddleware, store=store, policy=policy)],
    )


if __name__ == "__main__":
    main("asgi", create_app, __doc__.splitlines()[0])
