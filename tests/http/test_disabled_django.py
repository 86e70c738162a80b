"""`oncely.testing.disabled()` turns the Django middleware off (the other entry points:
``tests/test_disabled.py``): requests run unprotected and the store is never touched."""

from __future__ import annotations

import asyncio
import importlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import oncely
from oncely.testing import disabled
from tests.http.test_django import PAYMENT, _asgi_app


@pytest.fixture
def down() -> Iterator[Any]:
    """A store nothing answers for: touching it fails at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = oncely.open_store(f"redis://127.0.0.1:{port}/0")
    yield store
    store.close()


@pytest.mark.parametrize("stack", ["sync", "async"])
def test_django_middleware(
    down: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path, stack: str
) -> None:
    """The same payment twice: charged twice (no replay), no 503 (the store is never used)."""
    headers = {"idempotency-key": "k-1", "x-user": "alice"}
    with caplog.at_level(logging.WARNING, logger="oncely"), disabled():
        if stack == "async":
            module = importlib.import_module("django_async_app")
            app = _asgi_app(module.MIDDLEWARE, down, tmp_path / "payments.db")

            async def go() -> list[httpx.Response]:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
                    return [await c.post("/payments", json=PAYMENT, headers=headers) for _ in "ab"]

            first, again = asyncio.run(go())
        else:
            ledger = importlib.import_module("_payments").Ledger(tmp_path / "payments.db")
            wsgi = importlib.import_module("django_middleware_app").create_app(down, ledger)
            transport = httpx.WSGITransport(app=wsgi)
            with httpx.Client(transport=transport, base_url="http://api") as client:
                first, again = [
                    client.post("/payments", json=PAYMENT, headers=headers) for _ in "ab"
                ]
    assert (first.status_code, again.status_code) == (201, 201)
    assert "idempotent-replayed" not in again.headers
    assert first.json() != again.json()  # two charges
    assert sum("runs UNPROTECTED" in r.getMessage() for r in caplog.records) == 2
