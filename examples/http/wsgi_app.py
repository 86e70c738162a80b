"""A payments API as a bare WSGI app (no framework), protected by oncely's WSGI middleware.

Run it: ``python examples/http/wsgi_app.py --port 8000`` (needs waitress), then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

Per-route settings are given by path pattern, since a bare app has no views to decorate.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
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
from oncely.http.wsgi import IdempotencyMiddleware

StartResponse = Callable[..., Any]


def create_app(store: oncely.SyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Any:
    """The protected app: POST /payments, /transfers (key required), /webhooks (fail-open)."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if method == "POST" and path in ("/payments", "/transfers", "/webhooks"):
            return create_payment(environ, start_response)
        if path.startswith("/payments/") and method == "GET":
            payment = ledger.get(int(path.rsplit("/", 1)[1]))
            return respond(
                start_response, 200 if payment else 404, payment or {"error": "not found"}
            )
        if path.startswith("/payments/") and method == "PUT":
            return respond(start_response, 200, ledger.charge(adjustment(read_body(environ))))
        return respond(start_response, 404, {"error": "not found"})

    def create_payment(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        simulation = Simulation.from_query(dict(parse_qsl(environ.get("QUERY_STRING", ""))))
        payment = parse_payment(read_body(environ), environ.get("CONTENT_TYPE", ""))
        if payment is None:
            return respond(start_response, 400, {"error": "the body is not a payment object"})
        time.sleep(simulation.delay)
        charged = ledger.charge(payment)
        if simulation.fail == "raise":
            raise SimulatedFailure("the handler failed after charging")
        status = f"{simulation.status} {HTTPStatus(simulation.status).phrase}"
        content = simulation.body(charged)
        start_response(
            status,
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(content))),
                *payment_headers(charged["id"]),
            ],
        )
        return stream(simulation.pieces(content))

    return IdempotencyMiddleware(
        app,
        store=store,
        policy=policy,
        routes={
            "POST /transfers": RouteOptions(require_key=True),
            "POST /webhooks": RouteOptions(fail_open=True),
        },
    )


def stream(pieces: list[bytes]) -> Iterator[bytes]:
    """A generator response, as streaming WSGI apps return."""
    yield from pieces


def read_body(environ: dict[str, Any]) -> bytes:
    """Read the request body."""
    return bytes(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))


def respond(start_response: StartResponse, status: int, document: dict[str, Any]) -> list[bytes]:
    """Answer with a small JSON document."""
    body = json.dumps(document).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
    start_response(
        f"{status} {reason}",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
    )
    return [body]


if __name__ == "__main__":
    main("wsgi", create_app, __doc__.splitlines()[0])
