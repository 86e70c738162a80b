"""One Idempotency-Key from an HTTP request, through a Redis stream, to a consumer.

A client POSTs an order with ``Idempotency-Key: order-7``. The HTTP handler (a bare WSGI app
behind oncely's WSGI middleware) publishes an ``order-placed`` event stamped with the same key.
The first attempt crashes *after* publishing, so the middleware releases the key and the
client's retry runs the handler again: the event is published twice. The consumer, keyed by
the same header, applies it once. A third, late retry is answered from the HTTP record and
publishes nothing.

Run it (needs a Redis server; the oncely records live in a SQLite file)::

    python examples/consumers/http_to_consumer.py [redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis

import oncely
from oncely.consumers.producer import redis_fields
from oncely.consumers.redis_streams import RedisStreamConsumer, StreamEntry
from oncely.http.wsgi import IdempotencyMiddleware

StartResponse = Callable[..., Any]


def create_app(client: redis.Redis, stream: str, crashes: list[bool]) -> Callable[..., Any]:
    """POST /orders: publish an event carrying the request's key, then answer 201."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        key = environ["HTTP_IDEMPOTENCY_KEY"]
        order = json.loads(environ["wsgi.input"].read())
        client.xadd(stream, redis_fields(key, {"body": json.dumps(order)}))
        if crashes and crashes.pop():
            raise ConnectionError("the app died before answering")  # after publishing
        start_response("201 Created", [("Content-Type", "application/json")])
        return [json.dumps({"order": order["id"], "status": "placed"}).encode()]

    return app


def post(app: Callable[..., Any], path: str, body: dict[str, Any], key: str) -> tuple[str, bytes]:
    """Send one request through the WSGI stack, as a server would."""
    data = json.dumps(body).encode()
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SERVER_NAME": "example",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(data),
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(data)),
        "HTTP_IDEMPOTENCY_KEY": key,
    }
    started: list[tuple[str, list[tuple[str, str]]]] = []
    chunks = app(environ, lambda line, headers, exc_info=None: started.append((line, headers)))
    try:
        body = b"".join(chunks)
    finally:
        getattr(chunks, "close", lambda: None)()
    line, headers = started[0]
    replayed = any(name.lower() == "idempotent-replayed" for name, _ in headers)
    return line + (" (replayed)" if replayed else ""), body


def run(redis_url: str, workdir: Path) -> dict[str, Any]:
    """Play the scenario; return what each side saw."""
    client = redis.Redis.from_url(redis_url)
    stream = f"oncely-example-{uuid.uuid4().hex[:8]}"
    store = oncely.open_store(f"sqlite:///{workdir / 'oncely.db'}")
    shipped: list[str] = []
    try:
        app = IdempotencyMiddleware(create_app(client, stream, crashes=[True]), store=store)
        answers = []
        for attempt in range(3):  # the first attempt crashes, the client retries twice
            try:
                answers.append(post(app, "/orders", {"id": 7, "sku": "tea"}, "order-7")[0])
            except ConnectionError:
                answers.append(f"attempt {attempt + 1}: connection lost")

        def ship(entry: StreamEntry) -> None:  # the effect: once per key
            shipped.append(json.loads(entry.fields[b"body"])["sku"])

        consumer = RedisStreamConsumer(client, stream, "shipping", ship, store=store, block=0.1)
        consumer.create_group()
        while consumer.poll():
            pass
        return {
            "http": answers,
            "published": client.xlen(stream),
            "shipped": shipped,
            "consumer": consumer.stats.snapshot(),
        }
    finally:
        client.delete(stream)
        client.close()
        store.close()


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"
    with tempfile.TemporaryDirectory() as workdir:
        outcome = run(url, Path(workdir))
    for answer in outcome["http"]:
        print("HTTP  ", answer)
    print("events published:", outcome["published"])
    print("shipped:", outcome["shipped"], outcome["consumer"])


if __name__ == "__main__":
    main()
