"""A FastAPI payments API protected by oncely's ASGI middleware.

Run it: ``python examples/http/fastapi_app.py --port 8000`` (needs fastapi and uvicorn), or
``uvicorn --app-dir examples/http --factory fastapi_app:app_from_environment``, then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

``POST /transfers`` requires a key and ``POST /webhooks`` stays up when the store is down, both
set on the endpoint with `idempotent_route`.
"""

from __future__ import annotations

import asyncio
import os
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
from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

import oncely
from oncely.http import HttpPolicy, idempotent_route
from oncely.http.asgi import IdempotencyMiddleware


def create_app(
    store: oncely.AsyncStore, ledger: Ledger, policy: HttpPolicy | None = None
) -> FastAPI:
    """The payments API, with the middleware added."""
    app = FastAPI()

    async def charge(request: Request) -> Response:
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

    @app.post("/payments", status_code=201)
    async def create_payment(request: Request) -> Response:
        return await charge(request)

    # Endpoints in an included router are found by the middleware all the same.
    router = APIRouter()

    @router.post("/transfers", status_code=201)
    @idempotent_route(require_key=True)
    async def create_transfer(request: Request) -> Response:
        return await charge(request)

    @router.post("/webhooks", status_code=201)
    @idempotent_route(fail_open=True)
    async def receive_webhook(request: Request) -> Response:
        return await charge(request)

    app.include_router(router)

    @app.get("/payments/{payment_id}")
    async def get_payment(payment_id: int) -> dict[str, object]:
        payment = ledger.get(payment_id)
        if payment is None:
            raise HTTPException(404)
        return payment

    @app.put("/payments/{payment_id}")
    async def adjust_payment(payment_id: int, request: Request) -> dict[str, object]:
        return ledger.charge(adjustment(await request.body()))

    app.add_middleware(IdempotencyMiddleware, store=store, policy=policy)
    return app


def app_from_environment() -> FastAPI:
    """For ``uvicorn --factory``: the store and ledger from ONCELY_STORE_URL / PAYMENTS_DB."""
    store = oncely.open_store(os.environ.get("ONCELY_STORE_URL", "sqlite:///oncely.db"))
    return create_app(store, Ledger(os.environ.get("PAYMENTS_DB", "payments.db")))


if __name__ == "__main__":
    main("asgi", create_app, __doc__.splitlines()[0])
