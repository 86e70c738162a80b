"""Litestar: the ASGI middleware under Litestar's own middleware stack (it routes first), with
the route options on the handler (`idempotent_route`) and in its ``opt``. The main rows only;
the full suite runs the other frameworks."""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path

import pytest
from anyio.from_thread import BlockingPortal

import oncely
from oncely.http import HttpPolicy
from tests.http._harness import Api, FaultyStore


@pytest.fixture
def api(portal: BlockingPortal, tmp_path: Path) -> Api:
    module = importlib.import_module("litestar_app")
    ledger = importlib.import_module("_payments").Ledger(tmp_path / "payments.db")
    store = FaultyStore(oncely.open_store("memory://"))
    return Api(
        module.create_app(store, ledger, HttpPolicy(lease=0.5)), "asgi", portal, ledger, store
    )


def test_first_request_and_replay(api: Api) -> None:
    key = str(uuid.uuid4())
    first = api.post(key=key, json_body={"amount": 5})
    second = api.post(key=key, json_body={"amount": 5})
    assert first.status == 201
    assert second.replayed
    assert second.body == first.body
    assert second.header("location") == first.header("location")
    assert api.ledger.count() == 1


def test_decorated_handler_requires_a_key(api: Api) -> None:
    assert api.post("/transfers", json_body={"amount": 5}).status == 400
    assert api.ledger.count() == 0


def test_handler_opt_makes_the_route_fail_open(api: Api) -> None:
    api.store.inject("claim")
    assert api.post("/webhooks", key="k", json_body={"amount": 5}).status == 201
    assert api.post("/payments", key="k", json_body={"amount": 5}).status == 503


def test_mismatch_and_5xx(api: Api) -> None:
    key = str(uuid.uuid4())
    api.post(key=key, json_body={"amount": 5})
    assert api.post(key=key, json_body={"amount": 6}).status == 422
    other = str(uuid.uuid4())
    assert api.post(key=other, json_body={"amount": 5}, params={"fail": "500"}).status == 500
    assert api.post(key=other, json_body={"amount": 5}, params={"fail": "500"}).status == 500
    assert api.ledger.count() == 3
