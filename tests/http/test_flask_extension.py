"""Flask's extension form: `Idempotency(app)` and `Idempotency().init_app(app)`."""

from __future__ import annotations

from pathlib import Path

import flask
import pytest

import oncely
from oncely.http.flask import Idempotency
from oncely.http.wsgi import IdempotencyMiddleware


def make_app() -> tuple[flask.Flask, list[int]]:
    app = flask.Flask(__name__)
    charges: list[int] = []

    @app.post("/payments")
    def create_payment() -> tuple[flask.Response, int]:
        charges.append(flask.request.get_json()["amount"])
        return flask.jsonify(id=len(charges)), 201

    return app, charges


def post_twice(app: flask.Flask) -> tuple[flask.Response, flask.Response]:
    client = app.test_client()
    headers = {"Idempotency-Key": "k-1"}
    first = client.post("/payments", json={"amount": 500}, headers=headers)
    return first, client.post("/payments", json={"amount": 500}, headers=headers)


def test_app_given_at_construction() -> None:
    app, charges = make_app()
    Idempotency(app, store=oncely.open_store("memory://"))
    first, again = post_twice(app)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert charges == [500]
    assert isinstance(app.extensions["oncely"], IdempotencyMiddleware)


def test_app_factory_reads_the_store_url_from_config(tmp_path: Path) -> None:
    idempotency = Idempotency()
    app, charges = make_app()
    app.config["ONCELY_STORE_URL"] = f"sqlite:///{tmp_path}/o.db"
    middleware = idempotency.init_app(app)
    post_twice(app)
    assert charges == [500]
    middleware.store.close()  # type: ignore[attr-defined]


def test_no_store_and_double_init_are_configuration_errors() -> None:
    app, _ = make_app()
    with pytest.raises(oncely.ConfigurationError, match="ONCELY_STORE_URL"):
        Idempotency(app)
    Idempotency(app, store="memory://")
    with pytest.raises(oncely.ConfigurationError, match="already"):
        Idempotency(app, store="memory://")
