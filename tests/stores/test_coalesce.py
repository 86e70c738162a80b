"""CoalescingStore: concurrent single calls become batch calls, each caller its own answer."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest

import oncely
from oncely import Acquired, InProgress, LeaseLost, Replay, Status
from oncely.errors import CorruptRecordError, StoreUnavailableError
from oncely.stores._coalesce import SyncCompletions, _group
from oncely.stores._coalescing import CoalescingStore
from oncely.stores.memory import MemoryStore
from tests._proxy import Proxy
from tests.conftest import service_url

LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)


class CountingStore(MemoryStore):
    """A memory store whose calls take a loop turn (a round trip), recording each call; it can
    fail one key or the whole call."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []
        self.singles: list[str] = []
        self.corrupt: set[str] = set()
        self.down = False

    async def aclaim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> Any:
        self.singles.append("claim")
        await asyncio.sleep(0)
        if self.down:
            raise StoreUnavailableError("down", backend="memory")
        if key in self.corrupt:
            raise CorruptRecordError("bad", backend="memory", key=key)
        return await super().aclaim(key, fingerprint, lease=lease, ttl=ttl)

    async def acomplete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> Any:
        self.singles.append("complete")
        await asyncio.sleep(0)
        return await super().acomplete(key, token, result, ttl=ttl)

    async def aclaim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[Any]:
        self.batches.append(("claim", len(requests)))
        await asyncio.sleep(0)
        if self.down:
            raise StoreUnavailableError("down", backend="memory")
        answers: list[Any] = await super().aclaim_many(requests, lease=lease, ttl=ttl)
        return [
            CorruptRecordError("bad", backend="memory", key=key) if key in self.corrupt else answer
            for (key, _), answer in zip(requests, answers, strict=True)
        ]

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[Any]:
        self.batches.append(("complete", len(items)))
        await asyncio.sleep(0)
        answers: list[Any] = await super().acomplete_many(items, ttl=ttl)
        return answers


def calls(store: CountingStore, verb: str) -> int:
    """Items sent for *verb*, alone or in batches."""
    return store.singles.count(verb) + sum(n for name, n in store.batches if name == verb)


def test_an_idle_store_gets_single_calls_at_once() -> None:
    """Calls that find the store idle go out alone, as they come: no batching, no wait."""
    store = CountingStore()
    view = CoalescingStore(store)

    async def main() -> None:
        for index in range(3):
            assert await view.aclaim(f"k{index}", "fp", lease=LEASE, ttl=TTL) == Acquired(
                1, recovered=False, attempt=1
            )
            assert await view.acomplete(f"k{index}", 1, b"r", ttl=TTL) is None

    asyncio.run(main())
    assert store.singles == ["claim", "complete"] * 3
    assert store.batches == []


def test_calls_made_while_the_store_is_busy_go_together() -> None:
    """Past max_in_flight, the calls wait and go as one batch; each gets its own answer."""
    store = CountingStore()
    view = CoalescingStore(store, max_in_flight=2)

    async def main() -> tuple[list[Any], list[Any]]:
        keys = [f"k{index % 50}" for index in range(60)]  # ten keys twice
        claims = await asyncio.gather(*(view.aclaim(k, "fp", lease=LEASE, ttl=TTL) for k in keys))
        done = await asyncio.gather(
            *(view.acomplete(f"k{index}", 1, b"r", ttl=TTL) for index in range(50)),
            view.acomplete("k0", 1, b"again", ttl=TTL),
        )
        return claims, done

    claims, done = asyncio.run(main())
    assert claims[:50] == [Acquired(1, recovered=False, attempt=1)] * 50
    assert all(isinstance(answer, InProgress) for answer in claims[50:])
    assert done == [None] * 50 + [LeaseLost()]
    assert store.singles == ["claim", "claim", "complete", "complete"]
    assert store.batches == [("claim", 58), ("complete", 49)]


@pytest.mark.parametrize("spare", [True, False])
def test_a_burst_goes_alone_only_while_the_loop_has_cpu_to_spare(
    spare: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a burst, up to that many calls go alone while the loop's thread has CPU to spare;
    a loop short of CPU sends max_in_flight alone and the rest together. Same answers."""
    from oncely.stores import _coalesce

    monkeypatch.setattr(_coalesce, "SPARE_WINDOW", 0.0)  # measured at every call
    # Any CPU time is under an unbounded share of the window, and none is under no share.
    monkeypatch.setattr(_coalesce, "SPARE_BUSY", float("inf") if spare else 0.0)
    store = CountingStore()
    view = CoalescingStore(store, max_in_flight=2, burst=5)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(view.aclaim(f"k{index}", "fp", lease=LEASE, ttl=TTL) for index in range(12))
        )

    assert asyncio.run(main()) == [Acquired(1, recovered=False, attempt=1)] * 12
    alone = 5 if spare else 2
    assert store.singles == ["claim"] * alone
    assert store.batches == [("claim", 12 - alone)]


def test_an_items_own_error_reaches_only_its_caller() -> None:
    store = CountingStore()
    store.corrupt.add("bad")
    view = CoalescingStore(store, max_in_flight=1)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(view.aclaim(k, "fp", lease=LEASE, ttl=TTL) for k in ("a", "b", "bad", "c")),
            return_exceptions=True,
        )

    first, second, bad, last = asyncio.run(main())
    assert first == second == last == Acquired(1, recovered=False, attempt=1)
    assert isinstance(bad, CorruptRecordError)
    assert store.batches == [("claim", 3)]


def test_a_failed_call_fails_every_caller_of_the_batch() -> None:
    """The store down: the batch, sent again once to learn each item's outcome, fails again."""
    store = CountingStore()
    store.down = True
    view = CoalescingStore(store, max_in_flight=1)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(view.aclaim(f"k{i}", "fp", lease=LEASE, ttl=TTL) for i in range(5)),
            return_exceptions=True,
        )

    answers = asyncio.run(main())
    assert all(isinstance(answer, StoreUnavailableError) for answer in answers)
    assert store.batches == [("claim", 4), ("claim", 4)]
    assert store.get("k0") is None


def test_batches_are_bounded_and_split_by_options() -> None:
    store = CountingStore()
    view = CoalescingStore(store, max_in_flight=1, max_batch=4)

    async def main() -> None:
        await asyncio.gather(
            *(view.aclaim(f"a{i}", "fp", lease=LEASE, ttl=TTL) for i in range(11)),
            *(view.aclaim(f"b{i}", "fp", lease=LEASE * 2, ttl=TTL) for i in range(3)),
        )

    asyncio.run(main())
    assert store.singles == ["claim"]
    assert store.batches == [("claim", 4), ("claim", 4), ("claim", 2), ("claim", 3)]
    record = store.get("b0")
    assert record is not None
    assert record.lease_expires_at_ms - record.created_at_ms == 60_000


def test_a_cancelled_caller_does_not_disturb_the_others() -> None:
    store = CountingStore()
    view = CoalescingStore(store, max_in_flight=1)

    async def main() -> list[Any]:
        tasks = [
            asyncio.ensure_future(view.aclaim(f"k{i}", "fp", lease=LEASE, ttl=TTL))
            for i in range(4)
        ]
        await asyncio.sleep(0)  # all four submitted: one sent, three waiting
        tasks[2].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, second, cancelled, last = asyncio.run(main())
    assert first == second == last == Acquired(1, recovered=False, attempt=1)
    assert isinstance(cancelled, asyncio.CancelledError)
    assert store.batches == [("claim", 2)]  # the cancelled caller's claim was never sent
    assert store.get("k2") is None


def test_callers_of_a_batch_in_flight_are_answered_and_forgotten() -> None:
    """Each caller of a batch gets its answer; one cancelled while the batch is in flight is
    cancelled once its claim answered, and the lease it took is given back; nothing is kept
    for any caller afterwards."""
    gate, sent = asyncio.Event(), asyncio.Event()

    class Gated(CountingStore):
        async def aclaim_many(self, requests: Any, **options: Any) -> list[Any]:
            sent.set()
            await gate.wait()
            return await super().aclaim_many(requests, **options)

    store = Gated()
    view = CoalescingStore(store, max_in_flight=1, singles=False)

    async def main() -> list[Any]:
        tasks = [
            asyncio.ensure_future(view.aclaim(f"k{i}", "fp", lease=LEASE, ttl=TTL))
            for i in range(3)
        ]
        await sent.wait()  # the batch is in flight
        tasks[1].cancel()
        await asyncio.sleep(0)
        gate.set()
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        state = view._claims._loops[asyncio.get_running_loop()]
        assert not state.callers  # forgotten
        return answers

    first, cancelled, last = asyncio.run(main())
    assert first == last == Acquired(1, recovered=False, attempt=1)
    assert isinstance(cancelled, asyncio.CancelledError)
    assert store.batches == [("claim", 3)]
    record = store.get("k1")
    assert record is None or record.status is not Status.IN_PROGRESS  # given back


def test_other_verbs_pass_through() -> None:
    store = CountingStore()
    view = CoalescingStore(store)

    async def main() -> Any:
        assert await view.aclaim("k", "fp", lease=LEASE, ttl=TTL) == Acquired(
            1, recovered=False, attempt=1
        )
        assert await view.aextend("k", 1, lease=LEASE) is None
        assert await view.afail("k", 1, b"no", ttl=TTL) is None
        assert await view.arelease("k", 1) == LeaseLost()
        answers = await view.aclaim_many([("k", "fp")], lease=LEASE, ttl=TTL)
        assert await view.acomplete_many([], ttl=TTL) == []
        record = await view.aget("k")
        await view.aclose()
        return answers, record

    answers, record = asyncio.run(main())
    assert isinstance(answers[0], Replay)
    assert record is not None
    assert record.result == b"no"


@pytest.mark.parametrize("coalesce", [True, False])
def test_consumers_coalesce_concurrent_deliveries(coalesce: bool) -> None:
    """aprocess of concurrent deliveries: two batch calls in all with coalescing on."""
    from oncely.consumers import ConsumerPolicy, Delivery, IdempotentConsumer

    store = CountingStore()
    consumer = IdempotentConsumer(
        store, scope="test", policy=ConsumerPolicy(coalesce=coalesce), key="content"
    )
    effects: list[int] = []

    async def handle(index: int) -> None:
        effects.append(index)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(
                consumer.aprocess(Delivery(str(i % 20).encode()), lambda i=i: handle(i))
                for i in range(30)
            )
        )

    verdicts = asyncio.run(main())
    assert sorted(effects) == list(range(20))
    # A copy claimed while its original runs waits (a retry); one claimed after it is a replay.
    reasons = [verdict.reason.value for verdict in verdicts]
    assert reasons.count("processed") == 20
    assert reasons.count("duplicate") + reasons.count("in_progress") == 10
    assert calls(store, "claim") == 30
    assert calls(store, "complete") == 20
    if coalesce:  # a few go at once, the rest wait and go together
        assert store.singles.count("claim") <= 4
        assert store.batches
    else:
        assert store.batches == []


@pytest.mark.parametrize("coalesce", [True, False])
def test_http_middleware_coalesces_concurrent_requests(coalesce: bool) -> None:
    """Concurrent requests: one claim batch and one completion batch with coalescing on."""
    from oncely.http.asgi import IdempotencyMiddleware

    store = CountingStore()
    runs: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        runs.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"created"})

    middleware = IdempotencyMiddleware(app, store=store, coalesce=coalesce)

    async def post(key: str) -> int:
        sent: list[Any] = []

        async def receive() -> Any:
            return {"type": "http.request", "body": key.encode(), "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/payments",
            "query_string": b"",
            "headers": [(b"idempotency-key", key.encode())],
        }
        await middleware(scope, receive, send)
        return int(sent[0]["status"])

    async def main() -> list[int]:
        return await asyncio.gather(*(post(f"k{i}") for i in range(25)))

    assert asyncio.run(main()) == [201] * 25
    assert sorted(runs) == sorted(f"k{i}".encode() for i in range(25))
    assert calls(store, "claim") == calls(store, "complete") == 25
    if coalesce:
        assert store.singles.count("claim") <= 4
        assert store.batches
    else:
        assert store.batches == []


# -- the sync side: one sender thread ------------------------------------------------------------


class GatedStore(MemoryStore):
    """A memory store whose batch completions are counted, the first held until ``gate``;
    ``down`` fails every call."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.sent = threading.Event()
        self.gate = threading.Event()
        self.down = False

    def complete_many(self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta) -> Any:
        self.batches.append(len(items))
        self.sent.set()
        self.gate.wait()
        if self.down:
            raise StoreUnavailableError("down", backend="memory")
        return super().complete_many(items, ttl=ttl)


def _claimed(store: MemoryStore, count: int) -> list[tuple[str, int, bytes]]:
    items = []
    for index in range(count):
        answer = store.claim(f"k{index}", "fp", lease=LEASE, ttl=TTL)
        assert isinstance(answer, Acquired)
        items.append((f"k{index}", answer.token, b"r"))
    return items


@pytest.mark.parametrize("max_batch", [256, 3])
def test_sync_calls_made_while_one_is_in_flight_go_together(max_batch: int) -> None:
    """The sender thread sends one call at a time: what is queued meanwhile goes in the next
    ones, at most max_batch items each and split by options; each caller its own answer."""
    store = GatedStore()
    items = _claimed(store, 7)
    completions = SyncCompletions(store, max_batch=max_batch)
    first = completions.submit(items[0], {"ttl": TTL})
    assert store.sent.wait(10)
    rest = [completions.submit(item, {"ttl": TTL}) for item in items[1:5]]
    rest += [completions.submit(item, {"ttl": TTL * 2}) for item in items[5:]]
    again = completions.submit(items[1], {"ttl": TTL})  # completed by then: LeaseLost
    store.gate.set()
    completions.close()
    assert first.result() is None
    assert [future.result() for future in rest] == [None] * 6
    assert again.result() == LeaseLost()
    assert store.batches == ([1, 5, 2] if max_batch == 256 else [1, 3, 2, 2])


def test_sync_a_failed_call_fails_every_caller_of_the_batch() -> None:
    """The store down: the batch, sent again once to learn each item's outcome, fails again,
    and every caller gets the error."""
    store = GatedStore()
    items = _claimed(store, 3)
    store.down = True
    store.gate.set()
    completions = SyncCompletions(store)
    futures = [completions.submit(item, {"ttl": TTL}) for item in items]
    completions.close()
    for future in futures:
        assert isinstance(future.exception(), StoreUnavailableError)
    assert sum(store.batches) == 6  # each item sent twice
    record = store.get("k0")
    assert record is not None
    assert record.status is Status.IN_PROGRESS


# -- a batch call whose reply is lost, against the real Redis ----------------------------------


@pytest.fixture
def cutting() -> Iterator[tuple[Proxy, Any, Any]]:
    """A proxy to the shared Redis, a store through it (0.5 s timeouts, no re-sends of its
    own) and one that goes straight to the server, in a namespace of this test's own."""
    from tests.consumers.conftest import delete_namespace

    url = service_url("ONCELY_TEST_REDIS_URL")
    namespace = f"oncely-t-{uuid.uuid4().hex[:12]}"
    proxy = Proxy(urlsplit(url).port or 6379)
    through = oncely.open_store(
        f"redis://127.0.0.1:{proxy.port}/0?socket_timeout=0.5", namespace=namespace, retries=0
    )
    direct = oncely.open_store(url, namespace=namespace)
    yield proxy, through, direct
    asyncio.run(through.aclose())
    through.close()
    direct.close()
    proxy.close()
    delete_namespace(url, namespace)


async def _one_then_batch(first: Awaitable[Any], rest: list[Awaitable[Any]]) -> list[Any]:
    """*first* goes alone (the store is idle); *rest*, made while it is in flight, go as one
    batch call when it returns."""
    return await asyncio.gather(first, *rest, return_exceptions=True)


@pytest.mark.redis
def test_a_batch_of_completions_whose_reply_is_lost_is_resolved_per_caller(
    cutting: tuple[Proxy, Any, Any],
) -> None:
    """The completions ran but their reply never came: each caller learns its completion
    succeeded (the record shows its token and result), none gets the batch's timeout."""
    proxy, through, direct = cutting
    keys = ["plain", "cut-1", "cut-2", "cut-3"]
    tokens = {key: direct.claim(key, "fp", lease=LEASE, ttl=TTL).token for key in keys}
    view = CoalescingStore(through, max_in_flight=1)
    proxy.arm(b"cut-1", hold=True)

    async def main() -> list[Any]:
        complete = [view.acomplete(key, tokens[key], key.encode(), ttl=TTL) for key in keys]
        return await _one_then_batch(complete[0], complete[1:])

    assert asyncio.run(main()) == [None] * 4
    assert proxy.cut.is_set()
    for key in keys:
        record = direct.get(key)
        assert record is not None
        assert record.status is Status.COMPLETED


@pytest.mark.redis
def test_sync_a_batch_of_completions_whose_reply_is_lost_is_resolved_per_caller(
    cutting: tuple[Proxy, Any, Any],
) -> None:
    """The sync side, by the same rule: the completions ran but their reply never came, and
    each caller learns its completion succeeded."""
    proxy, through, direct = cutting
    keys = ["plain", "cut-1", "cut-2", "cut-3"]
    tokens = {key: direct.claim(key, "fp", lease=LEASE, ttl=TTL).token for key in keys}
    completions = SyncCompletions(through)
    proxy.arm(b"cut-1", hold=True)
    futures = [completions.submit((key, tokens[key], key.encode()), {"ttl": TTL}) for key in keys]
    completions.close()
    assert [future.result() for future in futures] == [None] * 4
    assert proxy.cut.is_set()
    for key in keys:
        record = direct.get(key)
        assert record is not None
        assert record.status is Status.COMPLETED


@pytest.mark.redis
def test_a_batch_of_claims_never_applied_is_answered_per_caller(
    cutting: tuple[Proxy, Any, Any],
) -> None:
    """The claims' connection broke before they reached the server: they are sent again and
    each caller gets its own answer, not the batch's error."""
    proxy, through, direct = cutting
    done = direct.claim("done-2", "fp", lease=LEASE, ttl=TTL).token
    assert direct.complete("done-2", done, b"r", ttl=TTL) is None
    view = CoalescingStore(through, max_in_flight=1)
    proxy.arm(b"cut-1", request=True)

    async def main() -> list[Any]:
        keys = ["plain", "cut-1", "done-2", "cut-3"]
        claims = [view.aclaim(key, "fp", lease=LEASE, ttl=TTL) for key in keys]
        return await _one_then_batch(claims[0], claims[1:])

    plain, first, done, last = asyncio.run(main())
    assert proxy.cut.is_set()
    assert plain == first == last == Acquired(1, recovered=False, attempt=1)
    assert isinstance(done, Replay)


@pytest.mark.redis
def test_a_batch_of_claims_applied_with_its_reply_lost_is_acquired_by_its_callers(
    cutting: tuple[Proxy, Any, Any],
) -> None:
    """The claims ran but their reply never came: the batch is sent again with the same call
    ids, so each caller gets its own lease (Acquired), not InProgress or the batch's timeout,
    and no key is left locked for a lease."""
    proxy, through, direct = cutting
    view = CoalescingStore(through, max_in_flight=1)
    proxy.arm(b"cut-1", hold=True)
    keys = ["plain", "cut-1", "cut-2", "cut-3"]

    async def main() -> list[Any]:
        claims = [view.aclaim(key, "fp", lease=LEASE, ttl=TTL) for key in keys]
        return await _one_then_batch(claims[0], claims[1:])

    answers = asyncio.run(main())
    assert proxy.cut.is_set()
    assert answers == [Acquired(1, recovered=False, attempt=1)] * 4
    for key, answer in zip(keys, answers, strict=True):
        assert direct.complete(key, answer.token, b"r", ttl=TTL) is None


# -- a batch call whose reply is lost, against the real PostgreSQL ----------------------------


@pytest.mark.postgres
def test_a_batch_of_claims_applied_with_its_reply_lost_is_acquired_on_postgres() -> None:
    """The batch's statements commit and their reply is cut, and so is the reply to the
    store's own re-send: the batch fails with its outcome unknown. The coalescer sends it once
    more with the same call ids, and each caller gets its own lease (Acquired), not InProgress
    (which left the keys locked for a lease) or the batch's error."""
    import psycopg

    from oncely.stores.postgres import PostgresStore

    url = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_t_{uuid.uuid4().hex[:12]}"
    suffix = uuid.uuid4().hex[:12]
    keys = [f"plain-{suffix}", f"cut-1-{suffix}", f"cut-2-{suffix}", f"cut-3-{suffix}"]
    port = int(psycopg.conninfo.conninfo_to_dict(url).get("port") or 5432)
    direct = PostgresStore(url, schema=schema)
    direct.migrate()
    try:
        with Proxy(port) as cutter:
            conninfo = psycopg.conninfo.make_conninfo(url, host="127.0.0.1", port=cutter.port)
            through = PostgresStore(conninfo, schema=schema)
            view = CoalescingStore(through, max_in_flight=1)
            # Cut the batch's reply and the reply to the store's own re-send, each once the
            # transaction committed (ReadyForQuery).
            cutter.arm(keys[1].encode(), until=b"Z\x00\x00\x00\x05", times=2)

            async def main() -> list[Any]:
                claims = [view.aclaim(key, "fp", lease=LEASE, ttl=TTL) for key in keys]
                answers = await _one_then_batch(claims[0], claims[1:])
                await through.aclose()
                return answers

            answers = asyncio.run(main())
            through.close()
            assert cutter.cuts == 2
        assert answers == [Acquired(1, recovered=False, attempt=1)] * 4
        for key, answer in zip(keys, answers, strict=True):
            assert direct.complete(key, answer.token, b"r", ttl=TTL) is None
    finally:
        direct.close()
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"ttl": TTL},
        {"lease": TTL, "ttl": TTL},
        {"ttl": TTL, "lease": TTL},
        {"ttl": TTL, "lease": TTL, "a": 1},
    ],
)
def test_calls_are_grouped_by_their_options_sorted_by_name(options: dict[str, Any]) -> None:
    """A call's group is its options sorted by name, whatever their order (the short cuts for
    none, one and two options included): calls with the same options go in one batch."""
    assert _group(options) == tuple(sorted(options.items()))
    assert _group(dict(reversed(options.items()))) == _group(options)
