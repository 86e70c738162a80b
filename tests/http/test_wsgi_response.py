"""WSGI responses that end badly after the handler ran: the record is never released.

The middleware buffers a response up to the size limit and streams a larger one. Whatever
happens once the handler has answered (its iterable raises mid-stream, its ``close()`` raises,
the server closes the stream without reading it), a retry never runs the handler again.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from oncely.http import HttpPolicy
from oncely.http.wsgi import IdempotencyMiddleware
from tests.http._harness import FaultyStore, Reply, call_wsgi

LIMIT = 1024
POLICY = HttpPolicy(lease=5, max_response_bytes=LIMIT)
BIG = b"x" * 512  # three of these are over the limit


class Body:
    """A WSGI response iterable: yields *chunks*, then raises *fail* (if any); its close()
    raises *close_fails* (if any)."""

    def __init__(
        self,
        chunks: Iterable[bytes],
        fail: BaseException | None = None,
        close_fails: BaseException | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.fail = fail
        self.close_fails = close_fails
        self.closed = 0

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        if self.fail is not None:
            raise self.fail

    def close(self) -> None:
        self.closed += 1
        if self.close_fails is not None:
            raise self.close_fails


class App:
    """Counts executions; answers 201 with the `Body` the test gives it."""

    def __init__(self, make_body: Any) -> None:
        self.executions = 0
        self.make_body = make_body
        self.bodies: list[Body] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        environ["wsgi.input"].read()
        self.executions += 1
        start_response("201 Created", [("Content-Type", "text/plain")])
        body = self.make_body()
        self.bodies.append(body)
        return body  # type: ignore[no-any-return]


def environ(key: str) -> dict[str, Any]:
    import io

    return {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/payments",
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "CONTENT_LENGTH": "0",
        "HTTP_IDEMPOTENCY_KEY": key,
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": io.StringIO(),
    }


def serve(app: Any, key: str, *, read: bool = True) -> tuple[list[str], bytes, Exception | None]:
    """Play a server: call, read the response (unless *read* is false), close; return the
    status line, the body sent, and the error the server would log."""
    status: list[str] = []

    def start_response(line: str, headers: Any, exc_info: Any = None) -> Any:
        status.append(line)
        return lambda data: None

    sent: list[bytes] = []
    error: Exception | None = None
    result = app(environ(key), start_response)
    try:
        if read:
            for chunk in result:
                sent.append(chunk)
    except Exception as exc:
        error = exc
    finally:
        try:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        except Exception as exc:
            error = error or exc
    if error is not None:
        logging.getLogger("tests.http").info("the server logs", exc_info=error)
    return status, b"".join(sent), error


def retry(app: Any, key: str) -> Reply:
    return call_wsgi(app, "POST", "/payments", headers=[(b"idempotency-key", key.encode())])


def problem_code(reply: Reply) -> str:
    assert reply.header("content-type") == "application/problem+json", reply
    return str(json.loads(reply.body)["code"])


@pytest.fixture
def key() -> str:
    return f"wsgi-{uuid.uuid4()}"


def test_streamed_response_that_raises_mid_stream_is_not_run_again(
    store: FaultyStore, key: str
) -> None:
    """A response over the limit is streamed; its iterable raises after the status and part
    of the body left. The handler ran: a retry answers ``response-not-stored``."""
    app = App(lambda: Body([BIG, BIG, BIG, BIG], fail=RuntimeError("broke mid-stream")))
    protected = IdempotencyMiddleware(app, store=store, policy=POLICY)
    status, sent, error = serve(protected, key)
    assert status == ["201 Created"]
    assert isinstance(error, RuntimeError)
    assert sent.startswith(BIG * 2)

    again = retry(protected, key)

    assert app.executions == 1
    assert store.calls["release"] == 0
    assert again.status == 500
    assert problem_code(again) == "response-not-stored"


def test_buffered_response_that_raises_mid_body_is_not_run_again(
    store: FaultyStore, key: str
) -> None:
    """The view returned and started its response; its body iterable raised (under the size
    limit, so nothing reached the client yet, and the server answers 500). The handler ran:
    a retry answers ``response-not-stored`` instead of running it again, as in ASGI."""
    app = App(lambda: Body([b"part"], fail=RuntimeError("broke mid-body")))
    protected = IdempotencyMiddleware(app, store=store, policy=POLICY)
    with pytest.raises(RuntimeError):
        serve(protected, key)

    again = retry(protected, key)

    assert app.executions == 1
    assert store.calls["release"] == 0
    assert again.status == 500
    assert problem_code(again) == "response-not-stored"


def test_close_that_raises_after_a_whole_response_replays_it(store: FaultyStore, key: str) -> None:
    """The app's iterable gave its whole body, then its ``close()`` raised (a teardown that
    failed). The response is stored and delivered; the server logs the close error; a retry
    replays the response."""
    app = App(lambda: Body([b"charged"], close_fails=RuntimeError("teardown failed")))
    protected = IdempotencyMiddleware(app, store=store, policy=POLICY)
    status, sent, error = serve(protected, key)
    assert (status, sent) == (["201 Created"], b"charged")
    assert isinstance(error, RuntimeError)
    assert app.bodies[0].closed == 1

    again = retry(protected, key)

    assert app.executions == 1
    assert again.replayed
    assert (again.status, again.body) == (201, b"charged")


def test_streamed_response_closed_unread_is_settled(store: FaultyStore, key: str) -> None:
    """The server closes a streamed response without reading it (its client left): the record
    is completed as not replayable, not left in progress behind a heartbeat."""
    app = App(lambda: Body([BIG, BIG, BIG]))
    protected = IdempotencyMiddleware(app, store=store, policy=POLICY)
    status, sent, error = serve(protected, key, read=False)
    assert (status, sent, error) == (["201 Created"], b"", None)
    assert app.bodies[0].closed == 1

    again = retry(protected, key)

    assert app.executions == 1
    assert again.status == 500
    assert problem_code(again) == "response-not-stored"
