"""The Redis store's direct path to its connections (`oncely.stores.redis._lanes`).

Every verb of the store runs on it (the rest of the Redis tests hold it to the contract); these
tests hold it to what redis-py's client did around each command: a connection goes back to the
pool whatever happens to its call, a forked child never writes on its parent's sockets, a call
cancelled in flight leaves no reply behind for the next one, and the clients that redis-py must
see command by command keep going through it.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest

from oncely import Acquired, Replay
from oncely.errors import StoreUnavailableError
from oncely.stores.redis import RedisStore
from oncely.stores.redis._lanes import AsyncLane, Gate, SyncLane
from tests._proxy import Proxy
from tests.conftest import service_url

LEASE = timedelta(seconds=30)
TTL = timedelta(minutes=5)


@pytest.fixture
def redis_url() -> str:
    return service_url("ONCELY_TEST_REDIS_URL")


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisStore]:
    with RedisStore(redis_url, namespace=_namespace()) as store:
        yield store


def _namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.mark.redis
class TestTheLaneIsTaken:
    def test_sync_and_async_calls_take_it(self, store: RedisStore) -> None:
        assert isinstance(store.claim("k", "fp", lease=LEASE, ttl=TTL), Acquired)
        assert isinstance(store._lane, SyncLane)

        async def run() -> object:
            assert isinstance(await store.aclaim("a", "fp", lease=LEASE, ttl=TTL), Acquired)
            return (await store._async_entry()).lane

        assert isinstance(asyncio.run(run()), AsyncLane)

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_resp3_clients_stay_on_redis_py(self, redis_url: str, mode: str) -> None:
        """RESP3 brings push notifications that redis-py's client must see: no lane."""
        key = f"k-{uuid.uuid4().hex}"
        with RedisStore(f"{redis_url}?protocol=3", namespace=_namespace()) as store:
            if mode == "sync":
                taken = store.claim(key, "fp", lease=LEASE, ttl=TTL)
                assert isinstance(taken, Acquired)
                assert store.complete(key, taken.token, b"r", ttl=TTL) is None
                assert isinstance(store.claim(key, "fp", lease=LEASE, ttl=TTL), Replay)
                assert store._lane is None
            else:

                async def run() -> None:
                    taken = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
                    assert isinstance(taken, Acquired)
                    assert await store.acomplete(key, taken.token, b"r", ttl=TTL) is None
                    assert isinstance(await store.aclaim(key, "fp", lease=LEASE, ttl=TTL), Replay)
                    assert (await store._async_entry()).lane is None
                    await store.aclose()

                asyncio.run(run())


@pytest.mark.redis
class TestConnectionsGoBack:
    """One connection, and a reply cut on its way (`tests._proxy.Proxy`), with no re-send: the call
    fails on its own error, and the calls after it find the connection free again (a leaked
    one would leave them no connection at all)."""

    def test_after_a_sync_call_fails(self, redis_url: str) -> None:
        port = int(redis_url.rpartition(":")[2].partition("/")[0])
        with Proxy(port) as cutter:
            url = f"redis://127.0.0.1:{cutter.port}/0"
            with RedisStore(url, namespace=_namespace(), retries=0, max_connections=1) as store:
                assert isinstance(store.claim("warm", "fp", lease=LEASE, ttl=TTL), Acquired)
                for round_ in range(3):
                    cutter.arm(f"cut-{round_}".encode())
                    with pytest.raises(StoreUnavailableError) as caught:
                        store.claim(f"cut-{round_}", "fp", lease=LEASE, ttl=TTL)
                    assert "ConnectionError" in str(caught.value)
                    answer = store.claim(f"after-{round_}", "fp", lease=LEASE, ttl=TTL)
                    assert isinstance(answer, Acquired)
                assert not store._client.connection_pool._in_use_connections

    def test_after_an_async_call_fails(self, redis_url: str) -> None:
        port = int(redis_url.rpartition(":")[2].partition("/")[0])

        async def run(url: str, cutter: Proxy) -> None:
            store = RedisStore(url, namespace=_namespace(), retries=0, max_connections=1)
            try:
                assert isinstance(await store.aclaim("warm", "fp", lease=LEASE, ttl=TTL), Acquired)
                for round_ in range(3):
                    cutter.arm(f"cut-{round_}".encode())
                    with pytest.raises(StoreUnavailableError) as caught:
                        await store.aclaim(f"cut-{round_}", "fp", lease=LEASE, ttl=TTL)
                    assert "ConnectionError" in str(caught.value)
                    answer = await store.aclaim(f"after-{round_}", "fp", lease=LEASE, ttl=TTL)
                    assert isinstance(answer, Acquired)
            finally:
                await store.aclose()

        with Proxy(port) as cutter:
            asyncio.run(run(f"redis://127.0.0.1:{cutter.port}/0", cutter))

    @pytest.mark.redis
    def test_a_cancelled_async_call_leaves_no_reply_for_the_next(self, store: RedisStore) -> None:
        """A call cancelled while its reply is on the way: the next call on the loop reads its
        own reply, not the one the cancelled call left on the connection."""

        async def run() -> None:
            for key, result in (("one", b"first"), ("two", b"second")):
                taken = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
                assert isinstance(taken, Acquired)
                assert await store.acomplete(key, taken.token, result, ttl=TTL) is None
            for _ in range(20):
                pending = asyncio.ensure_future(store.aclaim("one", "fp", lease=LEASE, ttl=TTL))
                await asyncio.sleep(0)  # the command is out; its reply is not read yet
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
                answer = await store.aclaim("two", "fp", lease=LEASE, ttl=TTL)
                assert isinstance(answer, Replay)
                assert answer.record.result == b"second"

        asyncio.run(run())


@pytest.mark.redis
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_uses_connections_of_its_own(store: RedisStore) -> None:
    """The parent's idle connections stay the parent's: the child's calls connect afresh, and
    the parent's connection still serves the parent afterwards."""
    key = f"k-{uuid.uuid4().hex}"
    taken = store.claim(key, "fp", lease=LEASE, ttl=TTL)
    assert isinstance(taken, Acquired)
    parent_connection = store._client.connection_pool._available_connections[-1]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            used: list[object] = []
            send = parent_connection.send_command

            def spy(*args: object, **kwargs: object) -> None:
                used.append(args)
                send(*args, **kwargs)

            parent_connection.send_command = spy
            answer = store.claim(key, "fp", lease=LEASE, ttl=TTL)
            code = 0 if type(answer).__name__ == "InProgress" and not used else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"\x00"
    finally:
        os.close(read)
        os.waitpid(child, 0)
    assert store.complete(key, taken.token, b"r", ttl=TTL) is None
    assert store._client.connection_pool._available_connections[-1] is parent_connection
    assert isinstance(store.claim(key, "fp", lease=LEASE, ttl=TTL), Replay)


@pytest.mark.redis
class TestACancelledCaller:
    """The store's own answer to a caller cancelled in the middle of a claim or a finish (the
    entry points await these verbs without a task of their own to shield them): a claim that
    may have been applied is sent again, finds its own lease and gives it back; a finish is
    sent again and lands."""

    def test_a_claim_whose_reply_never_came_is_given_back(self, redis_url: str) -> None:
        port = int(redis_url.rpartition(":")[2].partition("/")[0])
        key = f"held-{uuid.uuid4().hex}"

        async def run(proxy: Proxy) -> None:
            store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", namespace=_namespace())
            try:
                await store.aget("warm-up")
                proxy.arm(key.encode(), hold=True)  # applied on the server, its reply held
                claiming = asyncio.ensure_future(store.aclaim(key, "fp", lease=LEASE, ttl=TTL))
                assert await asyncio.to_thread(proxy.cut.wait, 10)  # it reached the server
                claiming.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await claiming
                answer = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
                assert isinstance(answer, Acquired)  # not InProgress: the lease came back
                assert answer.attempt == 2
            finally:
                await store.aclose()

        with Proxy(port) as proxy:
            asyncio.run(run(proxy))

    @pytest.mark.parametrize("verb", ["complete", "fail"])
    def test_a_finish_cancelled_before_it_was_sent_lands(self, redis_url: str, verb: str) -> None:
        """Cancelled while it queues for the loop's one connection: sent all the same."""
        key = f"queued-{uuid.uuid4().hex}"

        async def run() -> None:
            store = RedisStore(redis_url, namespace=_namespace(), max_connections=1)
            try:
                taken = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
                assert isinstance(taken, Acquired)
                gate = (await store._async_entry()).gate
                gate.free -= 1  # the one connection is busy
                finish = store.acomplete if verb == "complete" else store.afail
                finishing = asyncio.ensure_future(finish(key, taken.token, b"r", ttl=TTL))
                await asyncio.sleep(0)  # it waits for the connection
                finishing.cancel()
                await asyncio.sleep(0)
                gate.release()
                with pytest.raises(asyncio.CancelledError):
                    await finishing
                answer = await store.aclaim(key, "fp", lease=LEASE, ttl=TTL)
                assert isinstance(answer, Replay)
                assert answer.record.result == b"r"
            finally:
                await store.aclose()

        asyncio.run(run())


class TestTheGate:
    """The slots of a loop's commands in flight (`Gate`): past them, callers queue in turn."""

    def test_callers_past_the_slots_wait_in_turn(self) -> None:
        async def run() -> None:
            gate = Gate(1)
            gate.free -= 1
            order: list[str] = []

            async def caller(name: str) -> None:
                await gate.wait(None)
                order.append(name)
                gate.release()

            first = asyncio.ensure_future(caller("first"))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(caller("second"))
            await asyncio.sleep(0)
            assert order == []
            gate.release()
            await asyncio.gather(first, second)
            assert order == ["first", "second"]
            assert gate.free == 1

        asyncio.run(run())

    def test_a_cancelled_or_timed_out_caller_passes_its_turn_on(self) -> None:
        async def run() -> None:
            gate = Gate(1)
            gate.free -= 1
            with pytest.raises(asyncio.TimeoutError):
                await gate.wait(0.01)
            cancelled = asyncio.ensure_future(gate.wait(None))
            await asyncio.sleep(0)
            handed = asyncio.ensure_future(gate.wait(None))
            await asyncio.sleep(0)
            waiting = asyncio.ensure_future(gate.wait(None))
            await asyncio.sleep(0)
            cancelled.cancel()
            gate.release()  # goes to `handed`, past the cancelled caller
            handed.cancel()  # handed a slot, then cancelled before it ran: `waiting`'s
            with pytest.raises(asyncio.CancelledError):
                await handed
            await waiting
            gate.release()
            assert gate.free == 1

        asyncio.run(run())

    @pytest.mark.redis
    def test_no_free_slot_within_the_timeout_is_unavailable(self, redis_url: str) -> None:
        async def run() -> None:
            store = RedisStore(
                redis_url, namespace=_namespace(), max_connections=1, socket_timeout=0.2
            )
            try:
                assert isinstance(await store.aclaim("a", "fp", lease=LEASE, ttl=TTL), Acquired)
                gate = (await store._async_entry()).gate
                gate.free -= 1
                with pytest.raises(StoreUnavailableError, match="no connection free"):
                    await store.aclaim("b", "fp", lease=LEASE, ttl=TTL)
                gate.release()
                assert isinstance(await store.aclaim("b", "fp", lease=LEASE, ttl=TTL), Acquired)
                assert gate.free == 1
            finally:
                await store.aclose()

        asyncio.run(run())
