"""Every HTTP adapter (ASGI, WSGI, FastAPI, Starlette, Flask, Django in each mode) reports each
outcome; the httpx transport reports the server's answers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anyio.from_thread import BlockingPortal
from opentelemetry import trace

import oncely
import oncely.observe
from oncely.http.client import IdempotentTransport
from tests.http.conftest import adapter, make_api, portal, store  # noqa: F401  (fixtures)
from tests.observe.conftest import Sinks

PAYMENT = {"amount": 500, "currency": "EUR"}


@pytest.fixture(scope="session")
def backend_store(portal: BlockingPortal) -> Iterator[oncely.Store]:  # noqa: F811
    """The memory store: the adapters' outcomes do not depend on it."""
    made = oncely.open_store("memory://")
    yield made
    made.close()


def test_each_outcome_is_reported(make_api: Any, adapter: str, sinks: Sinks) -> None:  # noqa: F811
    api = make_api()
    key = f"key-{uuid.uuid4()}"
    assert api.post(key=key, json_body=PAYMENT).status < 300
    assert api.post(key=key, json_body=PAYMENT).status < 300  # replayed
    assert api.post(key=key, json_body={**PAYMENT, "amount": 1}).status == 422
    assert api.post("/transfers", json_body=PAYMENT).status == 400  # refused: no key
    api.store.inject("claim")
    try:
        assert api.post(key=f"key-{uuid.uuid4()}", json_body=PAYMENT).status == 503
    finally:
        api.store.heal()
    http = [event for event in sinks.operations(surface="http")]
    assert [event.outcome for event in http] == [
        "acquired",
        "replayed",
        "mismatch",
        "refused",
        "error",
    ]
    assert http[0].operation == "POST /payments"
    assert http[0].token is not None
    assert http[2].detail == "422"
    labels = {"surface": "http", "operation": "POST /payments", "store": http[0].store}
    assert sinks.prom("oncely_operations_total", **labels, outcome="replayed") == 1
    assert sinks.otel("oncely.operations", **labels, outcome="acquired") == 1
    verbs = {event.verb for event in sinks.events if isinstance(event, oncely.observe.StoreCall)}
    assert {"claim", "complete"} <= verbs
    failed = [
        event
        for event in sinks.events
        if isinstance(event, oncely.observe.StoreCall) and event.error is not None
    ]
    assert [(event.verb, event.error) for event in failed] == [("claim", "StoreUnavailableError")]


def test_outcome_goes_on_the_server_span(sinks: Sinks) -> None:
    """The request's span (a framework's, here the test's own) gets the outcome attributes."""
    from oncely.http.wsgi import IdempotencyMiddleware

    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("201 Created", [("content-type", "text/plain")])
        return [b"ok"]

    protected = IdempotencyMiddleware(app, store=oncely.open_store("memory://"))
    tracer = sinks.tracer_provider.get_tracer("server")
    with tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER):
        body = protected(
            {
                "REQUEST_METHOD": "POST",
                "PATH_INFO": "/orders",
                "HTTP_IDEMPOTENCY_KEY": "o-1",
                "wsgi.input": __import__("io").BytesIO(b""),
            },
            lambda status, headers, *exc: None,
        )
        assert b"".join(body) == b"ok"
    (server,) = sinks.finished("POST /orders")
    assert server.attributes["oncely.outcome"] == "acquired"
    assert server.attributes["oncely.fencing_token"] == 1
    assert "o-1" not in str(dict(server.attributes))


def test_httpx_transport_reports_the_servers_answers(sinks: Sinks) -> None:
    answers = iter(
        [
            httpx.Response(201),
            httpx.Response(201, headers={"Idempotent-Replayed": "true"}),
            httpx.Response(409),
            httpx.Response(422),
        ]
    )
    transport = IdempotentTransport(
        httpx.MockTransport(lambda request: next(answers)), max_attempts=1
    )
    with httpx.Client(transport=transport, base_url="http://payments.test") as client:
        for _ in range(4):
            client.post("/charges", json={})
    client_ops = sinks.operations(surface="client")
    assert [event.outcome for event in client_ops] == [
        "acquired",
        "replayed",
        "in_progress",
        "mismatch",
    ]
    assert {event.operation for event in client_ops} == {"POST payments.test"}
    labels = {"surface": "client", "operation": "POST payments.test", "store": "none"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="replayed") == 1


def test_httpx_transport_reports_an_unknown_outcome_as_an_error(sinks: Sinks) -> None:
    from oncely.http.client import OutcomeUnknownError

    def timed_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    transport = IdempotentTransport(httpx.MockTransport(timed_out), max_attempts=2, backoff=0.001)
    with (
        httpx.Client(transport=transport, base_url="http://payments.test") as client,
        pytest.raises(OutcomeUnknownError),
    ):
        client.post("/charges", json={})
    (event,) = sinks.operations(surface="client")
    assert (event.outcome, event.attempt, event.error) == ("error", 2, "OutcomeUnknownError")


def test_a_request_while_the_first_runs_is_in_progress(sinks: Sinks) -> None:
    import io
    import threading

    from oncely.http.wsgi import IdempotencyMiddleware

    statuses: list[str] = []

    def request() -> dict[str, Any]:
        return {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/orders",
            "HTTP_IDEMPOTENCY_KEY": "o-2",
            "wsgi.input": io.BytesIO(b""),
        }

    def app(environ: Any, start_response: Any) -> list[bytes]:
        # A copy of this request arrives (on another thread) while this one runs.
        duplicate = threading.Thread(
            target=protected, args=(request(), lambda status, *_: statuses.append(status))
        )
        duplicate.start()
        duplicate.join()
        start_response("201 Created", [])
        return [b""]

    protected = IdempotencyMiddleware(app, store=oncely.open_store("memory://"))
    protected(request(), lambda status, *_: statuses.append(status))
    assert [status[:3] for status in statuses] == ["409", "201"]
    assert [event.outcome for event in sinks.operations(surface="http")] == [
        "in_progress",
        "acquired",
    ]
    labels = {"surface": "http", "operation": "POST /orders", "store": "memory"}
    assert sinks.prom("oncely_operations_total", **labels, outcome="in_progress") == 1
