"""A FastAPI route that writes an order and its idempotency record in one PostgreSQL transaction.

Run it (needs fastapi, uvicorn and psycopg_pool; the database holds the orders and oncely's
records)::

    DATABASE_URL=postgresql://localhost/shop python examples/inbox/fastapi_orders.py --port 8000
    curl -i -X POST localhost:8000/orders -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"item": "book", "cents": 1200}'

The order row and the record commit together or not at all: a repeat of a committed request
replays its response (``Idempotent-Replayed: true``), and a request whose transaction rolled
back, or whose process died before the commit, left nothing, so its retry runs afresh. No lease,
no window in which the order exists without its record.

``X-Simulate: fail`` makes the handler raise after writing the order (the transaction rolls
back); ``X-Simulate: crash`` kills the process there, as a SIGKILL would.
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import oncely

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS orders (
    id text PRIMARY KEY, item text NOT NULL, cents integer NOT NULL, created_at timestamptz
)
"""


class OrderIn(BaseModel):
    item: str
    cents: int


def create_app(database_url: str, store_url: str | None = None) -> FastAPI:
    """The orders API over *database_url* (oncely's records in the same database: by default
    in its ``public`` schema, or where *store_url* says)."""
    store = oncely.open_store(store_url or database_url)
    inbox = oncely.Inbox(store)
    pool = AsyncConnectionPool(database_url, open=False, min_size=1, max_size=4)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store.migrate()  # type: ignore[attr-defined]  # once, at deployment, in a real service
        await pool.open()
        async with pool.connection() as connection:
            await connection.execute(SCHEMA_SQL)
        yield
        await pool.close()
        store.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def create_order(
        order: OrderIn,
        idempotency_key: str = Header(),
        x_simulate: str | None = Header(default=None),
    ) -> JSONResponse:
        try:
            async with (
                pool.connection() as connection,
                connection.transaction(),
                inbox.aclaim(
                    connection,
                    idempotency_key,
                    scope="orders.create",
                    fingerprint=order.model_dump(),
                ) as entry,
            ):
                if entry.replayed:
                    return JSONResponse(
                        entry.result, status_code=201, headers={"Idempotent-Replayed": "true"}
                    )
                order_id = f"ord_{uuid.uuid4().hex[:12]}"
                await connection.execute(
                    "INSERT INTO orders VALUES (%s, %s, %s, now())",
                    (order_id, order.item, order.cents),
                )
                if x_simulate == "crash":
                    os._exit(9)  # the transaction dies with the process: neither row commits
                if x_simulate == "fail":
                    raise RuntimeError("the handler failed after writing the order")
                body = {"id": order_id, "item": order.item, "cents": order.cents}
                entry.complete(body)
        except oncely.InvalidKeyError as exc:
            raise HTTPException(400, str(exc)) from exc
        except oncely.FingerprintMismatchError as exc:
            raise HTTPException(422, "this key was used for another order") from exc
        except oncely.InProgressError as exc:
            raise HTTPException(409, "this order is being placed", {"Retry-After": "1"}) from exc
        return JSONResponse(body, status_code=201)

    return app


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args()
    uvicorn.run(create_app(os.environ["DATABASE_URL"]), port=arguments.port)
