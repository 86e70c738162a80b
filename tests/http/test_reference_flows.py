"""The ASGI middleware's hand-inlined straight line answers as the reference flows do.

With `oncely._switches.reference_flows` on, every protected request is claimed by
`oncely.http._flow.begin` and its whole response settled by `_flow.finish`; off, the common
cases take the middleware's inlined claim and `_flow.afinish`. One script of requests runs
both ways and must get the same answers, run the handler the same number of times, and leave
the same records.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from oncely import _switches
from oncely.http import HttpPolicy, _flow
from oncely.http.asgi import IdempotencyMiddleware
from oncely.stores.memory import MemoryStore

from ._harness import FaultyStore, Headers, Reply, call_asgi


class _App:
    """A bare ASGI app: ``/ok`` answers 201 with how often it ran, ``/fail`` 500, ``/cut``
    starts a response then raises, ``/slow`` waits for `gate` before answering 201.

    The events are made inside the test's loop."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        path = scope["path"]
        self.runs[path] += 1
        if path == "/slow":
            self.entered.set()
            await self.gate.wait()
        status = {"/fail": 500}.get(path, 201)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        if path == "/cut":
            await send({"type": "http.response.body", "body": b"{", "more_body": True})
            raise RuntimeError("the handler broke mid-response")
        payload = {"path": path, "run": self.runs[path], "body": body.decode()}
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def _headers(key: str | None, body: bytes) -> Headers:
    headers: Headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    return headers


async def _script(middleware: IdempotencyMiddleware, app: _App, store: FaultyStore) -> list[Any]:
    """Every answer of one fixed script of requests, as comparable tuples."""
    answers: list[Any] = []

    async def post(path: str, key: str | None, body: bytes = b'{"amount": 1}') -> Reply:
        return await call_asgi(middleware, "POST", path, headers=_headers(key, body), chunks=[body])

    def note(reply: Reply) -> None:
        answers.append((reply.status, reply.comparable_headers(), reply.body, reply.replayed))

    note(await post("/ok", "k1"))  # a new key: run and stored
    note(await post("/ok", "k1"))  # its replay
    note(await post("/ok", "k1", b'{"amount": 2}'))  # same key, another body: 422
    note(await post("/ok", None))  # no key: passed through
    note(await post("/ok", ""))  # an invalid key: 400
    note(await post("/fail", "k2"))  # 500: released
    note(await post("/fail", "k2"))  # so it runs again
    with pytest.raises(RuntimeError):
        await post("/cut", "k3")  # started, then cut short: never released
    note(await post("/cut", "k3"))  # the repeat is told the response was not stored
    first = asyncio.ensure_future(post("/slow", "k4"))
    await app.entered.wait()
    note(await post("/slow", "k4"))  # in progress: 409
    app.gate.set()
    note(await first)
    note(await post("/slow", "k4"))  # then replayed
    store.inject("claim", 1)
    note(await post("/ok", "k5"))  # the store is down: 503
    note(await post("/ok", "k5"))  # and back
    inner = store.inner
    assert isinstance(inner, MemoryStore)
    answers.append(sorted((r.status, r.result) for r in inner._records.values()))
    answers.append(sorted(app.runs.items()))
    answers.append(dict(store.calls))
    return answers


def _answers(monkeypatch: pytest.MonkeyPatch, switched: bool) -> tuple[list[Any], Counter[str]]:
    monkeypatch.setattr(_switches, "reference_flows", switched)
    taken: Counter[str] = Counter()
    for name in ("begin", "afinish", "finish"):
        original = getattr(_flow, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            taken[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(_flow, name, counted)
    app = _App()
    store = FaultyStore(MemoryStore())
    middleware = IdempotencyMiddleware(app, store=store, policy=HttpPolicy())  # type: ignore[arg-type]

    async def main() -> list[Any]:
        return await _script(middleware, app, store)

    answers = asyncio.run(main())
    monkeypatch.undo()
    return answers, taken


def test_the_straight_line_answers_as_the_reference_flows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast, fast_taken = _answers(monkeypatch, False)
    reference, reference_taken = _answers(monkeypatch, True)

    assert fast == reference
    statuses = [answer[0] for answer in fast[:-3]]
    assert statuses == [201, 201, 422, 201, 400, 500, 500, 500, 409, 201, 201, 503, 201]
    assert [status.value for status, _ in fast[-3]].count("released") == 1  # k2's
    assert fast[-2] == [("/cut", 1), ("/fail", 2), ("/ok", 3), ("/slow", 1)]
    # The fast path leaves the flows to the uncommon answers; the reference takes them always.
    assert fast_taken["finish"] == 0
    assert fast_taken["afinish"] == 5  # the whole responses: k1's, k2's two, k4's and k5's
    assert reference_taken["afinish"] == 0
    assert reference_taken["finish"] == 5
    assert reference_taken["begin"] == 12  # every request with a valid key
    assert fast_taken["begin"] < reference_taken["begin"]
