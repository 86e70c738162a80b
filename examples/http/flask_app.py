"""A Flask payments API protected by oncely's WSGI middleware.

Run it: ``python examples/http/flask_app.py --port 8000`` (needs flask and waitress), then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

``POST /transfers`` requires a key and ``POST /webhooks`` stays up when the store is down, both
set on the view with `idempotent_route`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from _payments import (
    Ledger,
    SimulatedFailure,
    Simulation,
    adjustment,
    main,
    parse_payment,
    payment_headers,
)
from flask import Flask, Response, abort, jsonify, request

import oncely
from oncely.http import HttpPolicy, idempotent_route
from oncely.http.wsgi import IdempotencyMiddleware


def create_app(store: oncely.SyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Flask:
    """The payments API, with the middleware wrapped around ``app.wsgi_app``."""
    app = Flask(__name__)

    def charge() -> Response:
        simulation = Simulation.from_query(request.args)
        payment = parse_payment(request.get_data(), request.content_type or "")
        if payment is None:
            return Response(
                b'{"error": "the body is not a payment object"}', 400, mimetype="application/json"
            )
        time.sleep(simulation.delay)
        charged = ledger.charge(payment)
        if simulation.fail == "raise":
            raise SimulatedFailure("the handler failed after charging")
        status = simulation.status
        content = simulation.body(charged)
        headers = payment_headers(charged["id"])
        if simulation.chunks == 1:
            return Response(content, status, headers, mimetype="application/json")

        def pieces() -> Iterator[bytes]:
            yield from simulation.pieces(content)

        headers.append(("content-length", str(len(content))))
        return Response(pieces(), status, headers, mimetype="application/json")

    @app.post("/payments")
    def create_payment() -> Response:
        return charge()

    @app.post("/transfers")
    @idempotent_route(require_key=True)
    def create_transfer() -> Response:
        return charge()

    @app.post("/webhooks")
    @idempotent_route(fail_open=True)
    def receive_webhook() -> Response:
        return charge()

    @app.get("/payments/<int:payment_id>")
    def get_payment(payment_id: int) -> Response:
        found = ledger.get(payment_id)
        if found is None:
            abort(404)
        return jsonify(found)

    @app.put("/payments/<int:payment_id>")
    def adjust_payment(payment_id: int) -> Response:
        return jsonify(ledger.charge(adjustment(request.get_data())))

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=store, policy=policy)  # type: ignore[method-assign]
    return app


if __name__ == "__main__":
    main("wsgi", create_app, __doc__.splitlines()[0])
