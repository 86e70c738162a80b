"""@idempotent on sync and async functions, over the memory and SQLite stores."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path, PurePath
from typing import Any

import pydantic
import pytest

import oncely
from oncely import (
    ConfigurationError,
    CorruptRecordError,
    FingerprintError,
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    ResultUnavailableError,
    Store,
)
from oncely.stores.memory import MemoryStore
from oncely.stores.sqlite import SQLiteStore
from oncely.testing import FrozenClock
from tests._helpers import SyncOnlyStore


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    made: Store = (
        MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "oncely.db")
    )
    yield made
    made.close()


@dataclasses.dataclass
class Receipt:
    payment_id: str
    cents: int


class Model(pydantic.BaseModel):
    name: str
    tags: list[str]


class CardDeclined(Exception):
    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason, code)
        self.reason = reason
        self.code = code


class TestSync:
    def test_runs_once_and_replays(self, store: Store) -> None:
        """The first call runs; repeats, positional or keyword, replay the stored value."""
        calls: list[str] = []

        @oncely.idempotent(store=store, key="payment_id")
        def charge(payment_id: str, cents: int) -> Receipt:
            calls.append(payment_id)
            return Receipt(payment_id, cents)

        first = charge("p1", 500)
        assert charge("p1", 500) == first
        assert charge(payment_id="p1", cents=500) == first
        assert charge("p1", cents=500) == first
        assert isinstance(charge("p1", 500), Receipt)
        assert calls == ["p1"]
        charge("p2", 500)
        assert calls == ["p1", "p2"]

    @pytest.mark.parametrize("value", [0, "", [], {}, None, False, 0.0, [None], {"a": []}])
    def test_falsy_values_replay_exactly(self, store: Store, value: Any) -> None:
        """0, "", [], None and friends replay as themselves, not as a miss."""
        calls = []

        @oncely.idempotent(store=store, key="k")
        def op(k: str) -> Any:
            calls.append(k)
            return value

        assert op("a") == value
        replayed = op("a")
        assert replayed == value
        assert type(replayed) is type(value)
        assert len(calls) == 1

    def test_models_and_containers_are_rebuilt_from_annotations(self, store: Store) -> None:
        """Dataclasses, pydantic models and tuples come back as their annotated types."""

        @oncely.idempotent(store=store, key="k")
        def op(k: str) -> tuple[Receipt, list[Model], Model | None]:
            return (Receipt(k, 1), [Model(name="m", tags=["x"])], None)

        first = op("a")
        second = op("a")
        assert second == first
        assert isinstance(second, tuple)
        assert isinstance(second[1][0], Model)

    def test_other_arguments_with_same_key_raise_mismatch(self, store: Store) -> None:
        """The same key with other arguments is a client bug: FingerprintMismatchError."""

        @oncely.idempotent(store=store, key="payment_id")
        def charge(payment_id: str, cents: int) -> int:
            return cents

        charge("p", 1)
        with pytest.raises(FingerprintMismatchError) as info:
            charge("p", 2)
        assert "p" in info.value.key

    def test_fingerprint_choices(self, store: Store) -> None:
        """fingerprint=None skips the check; a list of names limits it; a callable defines it."""

        @oncely.idempotent(store=store, key="k", fingerprint=None)
        def unchecked(k: str, x: int) -> int:
            return x

        @oncely.idempotent(store=store, key="k", fingerprint=["x"])
        def by_name(k: str, x: int, trace: str) -> int:
            return x

        @oncely.idempotent(store=store, key="k", fingerprint=lambda k, x: x % 10)
        def by_callable(k: str, x: int) -> int:
            return x

        assert unchecked("a", 1) == 1
        assert unchecked("a", 2) == 1
        assert by_name("a", 1, "t1") == 1
        assert by_name("a", 1, "t2") == 1
        assert by_callable("a", 3) == 3
        assert by_callable("a", 13) == 3
        with pytest.raises(FingerprintMismatchError):
            by_callable("a", 4)

    def test_unfingerprintable_argument_is_a_clear_error(self, store: Store) -> None:
        """An argument without a canonical form raises before anything runs or is stored."""
        calls = []

        @oncely.idempotent(store=store, key="k")
        def op(k: str, session: object) -> None:
            calls.append(k)

        with pytest.raises(FingerprintError, match="fields that define the operation"):
            op("a", object())
        assert calls == []

    def test_methods_leave_self_out_of_the_fingerprint(self, store: Store) -> None:
        """Two instances of a service class share keys: `self` is not part of the fingerprint."""
        calls = []

        class Service:
            @oncely.idempotent(store=store, key="order_id")
            def ship(self, order_id: str) -> str:
                calls.append(order_id)
                return f"shipped {order_id}"

        assert Service().ship("o1") == Service().ship("o1") == "shipped o1"
        assert calls == ["o1"]

    def test_key_callable_and_explicit_key(self, store: Store) -> None:
        """A key callable sees the bound arguments; with_key() overrides it per call."""
        calls = []

        @oncely.idempotent(store=store, key=lambda order, amount=0: f"order:{order['id']}")
        def pay(order: dict[str, Any], amount: int = 0) -> int:
            calls.append(order["id"])
            return amount

        assert pay({"id": 1}, amount=5) == 5
        assert pay(order={"id": 1}, amount=5) == 5
        assert pay.with_key("explicit")({"id": 1}, 5) == 5
        assert calls == [1, 1]

    def test_integer_keys_are_accepted(self, store: Store) -> None:
        """An int parameter used as the key is turned into its decimal string."""

        @oncely.idempotent(store=store, key="n")
        def op(n: int) -> int:
            return n * 2

        assert op(21) == op(21) == 42

    @pytest.mark.parametrize("bad", ["", "x" * 256, "new\nline", None])
    def test_invalid_key_is_rejected_before_the_store(self, store: Store, bad: Any) -> None:
        """A malformed key raises InvalidKeyError and the function does not run."""
        calls = []

        @oncely.idempotent(store=store, key="k")
        def op(k: Any) -> None:
            calls.append(k)

        with pytest.raises(InvalidKeyError):
            op(bad)
        assert calls == []

    def test_retryable_error_releases_the_lease(self, store: Store) -> None:
        """An exception not declared final releases the lease: the retry executes."""
        attempts = []

        @oncely.idempotent(store=store, key="k")
        def flaky(k: str) -> str:
            attempts.append(k)
            if len(attempts) == 1:
                raise ConnectionError("bank timed out")
            return "ok"

        with pytest.raises(ConnectionError):
            flaky("a")
        assert flaky("a") == "ok"
        assert flaky("a") == "ok"
        assert len(attempts) == 2

    def test_final_error_is_stored_and_replayed_as_same_type(self, store: Store) -> None:
        """A declared final error is stored; repeats raise the same type without running."""
        attempts = []

        @oncely.idempotent(store=store, key="k", final_errors=(CardDeclined,))
        def charge(k: str) -> None:
            attempts.append(k)
            raise CardDeclined("insufficient funds", 51)

        with pytest.raises(CardDeclined):
            charge("a")
        with pytest.raises(CardDeclined) as replayed:
            charge("a")
        assert (replayed.value.reason, replayed.value.code) == ("insufficient funds", 51)
        assert attempts == ["a"]

    def test_stored_error_of_undeclared_type_is_not_rebuilt(self, store: Store) -> None:
        """A stored error is rebuilt only as a declared type; otherwise ResultUnavailableError."""

        @oncely.idempotent(store=store, key="k", final_errors=(CardDeclined,), scope="charge")
        def charge(k: str) -> None:
            raise CardDeclined("no", 1)

        @oncely.idempotent(store=store, key="k", scope="charge")
        def charge_without_declaration(k: str) -> None:
            raise AssertionError("must not run")

        with pytest.raises(CardDeclined):
            charge("a")
        with pytest.raises(ResultUnavailableError, match="CardDeclined"):
            charge_without_declaration("a")

    def test_unserialisable_result_is_an_error_at_the_first_call_and_never_reruns(
        self, store: Store
    ) -> None:
        """The first call raises ResultUnavailableError (the codec's error chained), not only
        the replays; the operation took effect once and never runs again."""
        attempts = []

        @oncely.idempotent(store=store, key="k")
        def op(k: str) -> object:
            attempts.append(k)
            return threading.Lock()

        with pytest.raises(ResultUnavailableError, match="took effect once") as first:
            op("a")
        assert first.value.__cause__ is not None
        with pytest.raises(ResultUnavailableError):
            op("a")
        with pytest.raises(ResultUnavailableError):
            op("a")
        assert attempts == ["a"]

    def test_unserialisable_async_result_is_an_error_at_the_first_call(self, store: Store) -> None:
        """The async path tells the first caller too."""
        attempts = []

        @oncely.idempotent(store=store, key="k")
        async def op(k: str) -> object:
            attempts.append(k)
            return threading.Lock()

        with pytest.raises(ResultUnavailableError, match="took effect once"):
            asyncio.run(op("b"))
        with pytest.raises(ResultUnavailableError):
            asyncio.run(op("b"))
        assert attempts == ["b"]

    def test_corrupt_stored_result_fails_closed(self, store: Store) -> None:
        """A record whose result oncely did not write is an error, never a reason to rerun."""
        attempts = []

        @oncely.idempotent(store=store, key="k", scope="s")
        def op(k: str) -> int:
            attempts.append(k)
            return 1

        from oncely._core.fingerprint import digest

        answer = store.claim("s|a", digest([{"k": "a"}]), lease=timedelta(1), ttl=timedelta(1))
        assert isinstance(answer, oncely.Acquired)
        store.complete("s|a", answer.token, b"\x80not oncely", ttl=timedelta(hours=1))
        with pytest.raises(CorruptRecordError):
            op("a")
        assert attempts == []

    def test_concurrent_duplicate_raises_in_progress(self, store: Store) -> None:
        """While the first call runs, a duplicate raises InProgressError with retry_after."""
        started, finish = threading.Event(), threading.Event()

        @oncely.idempotent(store=store, key="k", lease=30)
        def slow(k: str) -> str:
            started.set()
            finish.wait(10)
            return "done"

        first = threading.Thread(target=slow, args=("a",))
        first.start()
        try:
            assert started.wait(10)
            with pytest.raises(InProgressError) as info:
                slow("a")
            assert timedelta(0) < info.value.retry_after <= timedelta(seconds=30)
        finally:
            finish.set()
            first.join()
        assert slow("a") == "done"

    def test_concurrent_duplicate_can_wait_for_the_result(self, store: Store) -> None:
        """on_conflict="wait": the duplicate returns the first call's result."""
        started, finish = threading.Event(), threading.Event()
        calls = []

        @oncely.idempotent(store=store, key="k", on_conflict="wait", wait_timeout=10)
        def slow(k: str) -> str:
            calls.append(k)
            started.set()
            finish.wait(10)
            return "done"

        results: list[str] = []
        first = threading.Thread(target=lambda: results.append(slow("a")))
        first.start()
        assert started.wait(10)
        second = threading.Thread(target=lambda: results.append(slow("a")))
        second.start()
        finish.set()
        first.join()
        second.join()
        assert results == ["done", "done"]
        assert calls == ["a"]

    def test_waiting_is_bounded(self, store: Store) -> None:
        """on_conflict="wait" gives up after wait_timeout with InProgressError."""
        started, finish = threading.Event(), threading.Event()

        @oncely.idempotent(store=store, key="k", on_conflict="wait", wait_timeout=0.2)
        def slow(k: str) -> None:
            started.set()
            finish.wait(10)

        first = threading.Thread(target=slow, args=("a",))
        first.start()
        try:
            assert started.wait(10)
            with pytest.raises(InProgressError):
                slow("a")
        finally:
            finish.set()
            first.join()

    def test_heartbeat_keeps_a_slow_call_from_being_taken_over(self, store: Store) -> None:
        """A call slower than its lease is not executed twice: the heartbeat extends it."""
        started, finish = threading.Event(), threading.Event()
        calls = []

        # A lease of 0.5 s leaves the heartbeat (every third) 330 ms of slack for a SQLite
        # commit that waits for a busy disk; the probes span two leases.
        @oncely.idempotent(store=store, key="k", lease=0.5, ttl=60)
        def slow(k: str) -> str:
            calls.append(k)
            started.set()
            finish.wait(10)
            return "done"

        first = threading.Thread(target=slow, args=("a",))
        first.start()
        try:
            assert started.wait(10)
            for _ in range(4):  # two leases' worth of time, probed along the way
                finish.wait(0.25)
                with pytest.raises(InProgressError):
                    slow("a")
        finally:
            finish.set()
            first.join()
        assert calls == ["a"]

    def test_lost_lease_is_reported_at_completion(self) -> None:
        """A worker whose lease was taken over learns it at complete: LeaseLostError."""
        clock = FrozenClock()
        store = MemoryStore(clock=clock)

        @oncely.idempotent(store=store, key="k", lease=1, heartbeat=False, scope="s")
        def op(k: str) -> str:
            clock.advance(timedelta(seconds=2))
            taken = store.claim("s|a", _fp("a"), lease=timedelta(seconds=1), ttl=timedelta(1))
            assert isinstance(taken, oncely.Acquired)
            assert taken.recovered
            return "late"

        with pytest.raises(LeaseLostError) as info:
            op("a")
        assert info.value.token == 1

    def test_store_given_as_url(self, tmp_path: Path) -> None:
        """store= accepts a URL."""

        @oncely.idempotent(store=f"sqlite:///{tmp_path}/x.db", key="k")
        def op(k: str) -> str:
            return k

        assert op("a") == "a"


def _fp(k: str) -> str:
    from oncely._core.fingerprint import digest

    return digest([{"k": k}])


class TestAsync:
    def test_runs_once_and_replays(self, store: Store) -> None:
        """Coroutine functions: one execution, replays afterwards, positional or keyword."""
        calls = []

        @oncely.idempotent(store=store, key="payment_id")
        async def charge(payment_id: str, cents: int) -> Receipt:
            calls.append(payment_id)
            await asyncio.sleep(0)
            return Receipt(payment_id, cents)

        async def main() -> None:
            first = await charge("p", 1)
            assert await charge(payment_id="p", cents=1) == first
            assert isinstance(await charge("p", 1), Receipt)

        asyncio.run(main())
        assert calls == ["p"]

    def test_concurrent_tasks_one_execution(self, store: Store) -> None:
        """Many tasks with one key: one runs, others get InProgressError or wait for it."""
        calls = []

        @oncely.idempotent(store=store, key="k", on_conflict="wait")
        async def op(k: str) -> str:
            calls.append(k)
            await asyncio.sleep(0.05)
            return "v"

        async def main() -> list[str]:
            return await asyncio.gather(*(op("a") for _ in range(20)))

        assert asyncio.run(main()) == ["v"] * 20
        assert calls == ["a"]

    def test_errors_and_final_errors(self, store: Store) -> None:
        """Async: retryable errors release, final errors replay as their type."""
        attempts = []

        @oncely.idempotent(store=store, key="k", final_errors=(CardDeclined,))
        async def op(k: str) -> None:
            attempts.append(k)
            if k == "retry" and attempts.count(k) == 1:
                raise TimeoutError
            if k == "final":
                raise CardDeclined("no", 5)

        async def main() -> None:
            with pytest.raises(TimeoutError):
                await op("retry")
            await op("retry")
            await op("retry")
            for _ in range(2):
                with pytest.raises(CardDeclined):
                    await op("final")

        asyncio.run(main())
        assert attempts == ["retry", "retry", "final"]

    def test_cancelled_call_releases_the_lease(self, store: Store) -> None:
        """A cancelled task releases its lease, so the retry runs at once."""
        calls = []
        started = asyncio.Event()

        @oncely.idempotent(store=store, key="k")
        async def op(k: str) -> str:
            calls.append(k)
            started.set()
            if len(calls) == 1:
                await asyncio.sleep(30)
            return "ok"

        async def main() -> None:
            task = asyncio.create_task(op("a"))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await op("a") == "ok"

        asyncio.run(main())
        assert calls == ["a", "a"]

    def test_sync_only_store_cannot_serve_coroutines(self, store: Store) -> None:
        """Decorating a coroutine function with a sync-only store fails at decoration time."""
        with pytest.raises(ConfigurationError, match="async"):

            @oncely.idempotent(store=SyncOnlyStore(store), key="k")
            async def op(k: str) -> None: ...


class TestConfiguration:
    def test_unknown_key_parameter(self) -> None:
        """A key naming no parameter fails when the decorator is applied."""
        with pytest.raises(ConfigurationError, match="no parameter 'order'"):

            @oncely.idempotent(store=MemoryStore(), key="order")
            def op(order_id: str) -> None: ...

    @pytest.mark.parametrize(
        "options",
        [
            {"lease": 0},
            {"lease": -1},
            {"ttl": 1, "lease": 5},
            {"on_conflict": "ignore"},
            {"final_errors": (int,)},
            {"lease": "30s"},
            {"fingerprint": "amount"},
            {"key": 5},
        ],
    )
    def test_bad_options_are_rejected(self, options: dict[str, Any]) -> None:
        """Nonsense options raise ConfigurationError at decoration time."""
        options = {"key": "k", **options}
        with pytest.raises(ConfigurationError):

            @oncely.idempotent(store=MemoryStore(), **options)
            def op(k: str) -> None: ...

    def test_unknown_store_scheme(self) -> None:
        """An unknown URL scheme names the known ones."""
        with pytest.raises(ConfigurationError, match="sqlite"):
            oncely.open_store("dynamo://x")


class TestCurrentLease:
    def test_sync_function_sees_its_lease(self, store: Store) -> None:
        """Inside the function, current_lease() gives the fencing token; outside, None."""
        seen: list[oncely.CurrentLease | None] = []

        @oncely.idempotent(store=store, key="k")
        def op(k: str) -> None:
            seen.append(oncely.current_lease())

        op("a")
        assert oncely.current_lease() is None
        lease = seen[0]
        assert lease is not None
        assert (lease.token, lease.attempt, lease.recovered) == (1, 1, False)
        assert lease.key.endswith("|a")

    def test_async_function_sees_its_lease(self, store: Store) -> None:
        """The lease is visible to a coroutine function, and only to its own task."""

        @oncely.idempotent(store=store, key="k")
        async def op(k: str) -> int:
            await asyncio.sleep(0)
            lease = oncely.current_lease()
            assert lease is not None
            return lease.token

        async def main() -> list[int]:
            return await asyncio.gather(op("a"), op("b"))

        assert asyncio.run(main()) == [1, 1]


class _ReplyLostOnce:
    """A store whose first complete is applied but answers as if the connection dropped."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.dropped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> Any:
        answer = self.inner.complete(key, token, result, ttl=ttl)
        if not self.dropped:
            self.dropped = True
            raise oncely.StoreUnavailableError("reply lost", backend="test")
        return answer


def test_completion_whose_reply_was_lost_is_not_a_lost_lease(store: Store) -> None:
    """A retried complete that finds its own earlier write applied succeeds quietly."""
    flaky = _ReplyLostOnce(store)
    calls = []

    @oncely.idempotent(store=flaky, key="k", heartbeat=False)  # type: ignore[arg-type]
    def op(k: str) -> str:
        calls.append(k)
        return "done"

    assert op("a") == "done"
    assert flaky.dropped
    assert op("a") == "done"
    assert calls == ["a"]


def test_async_heartbeat_keeps_a_slow_coroutine_from_being_taken_over(store: Store) -> None:
    """A coroutine slower than its lease is not run twice: the async heartbeat extends it."""
    calls = []

    @oncely.idempotent(store=store, key="k", lease=0.5, ttl=60)
    async def slow(k: str) -> str:
        calls.append(k)
        await asyncio.sleep(1.2)
        return "done"

    async def main() -> None:
        first = asyncio.create_task(slow("a"))
        for _ in range(4):  # probe over two leases' worth of time
            await asyncio.sleep(0.25)
            with pytest.raises(InProgressError):
                await slow("a")
        assert await first == "done"

    asyncio.run(main())
    assert calls == ["a"]


def test_short_async_calls_leave_no_heartbeat_behind(store: Store) -> None:
    """A call that ends before a third of its lease cancels the timer; nothing keeps running."""

    @oncely.idempotent(store=store, key="k", lease=30)
    async def quick(k: str) -> int:
        return 1

    async def main() -> None:
        assert await quick("a") == 1
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        assert pending == []

    asyncio.run(main())


class TestDecorationChecks:
    """What cannot be stored is refused when the function is decorated, not at a replay."""

    def test_generator_functions_are_refused(self) -> None:
        store = oncely.open_store("memory://")
        with pytest.raises(oncely.ConfigurationError, match="generator"):

            @oncely.idempotent(store=store, key="k")
            def numbers(k: str) -> Iterator[int]:
                yield 1

        with pytest.raises(oncely.ConfigurationError, match="generator"):

            @oncely.idempotent(store=store, key="k")
            async def anumbers(k: str) -> AsyncIterator[int]:
                yield 1

    def test_a_return_type_the_codec_cannot_store_is_refused(self) -> None:
        store = oncely.open_store("memory://")
        with pytest.raises(oncely.ConfigurationError, match="PurePath"):

            @oncely.idempotent(store=store, key="k")
            def where(k: str) -> PurePath:
                return PurePath(k)

    def test_uuid_and_int_keys(self) -> None:
        store = oncely.open_store("memory://")
        calls: list[object] = []

        @oncely.idempotent(store=store, key="k", scope="s")
        def f(k: object) -> None:
            calls.append(k)

        key = uuid.UUID(int=5)
        f(key)
        f(key)
        f(7)
        assert calls == [key, 7]
        assert store.get(f"s|{key}") is not None
        with pytest.raises(oncely.InvalidKeyError):
            f(True)


SCRIPT = """
import oncely

@oncely.idempotent(store="memory://", key="k")
def charge(k):
    return k

print(charge._oncely_plan.scope)
"""


@pytest.mark.parametrize("how", ["script", "module", "import"])
def test_default_scope_does_not_depend_on_how_the_program_started(tmp_path: Path, how: str) -> None:
    """python pkg/app.py, python -m pkg.app and import pkg.app give the same scope."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "app.py").write_text(SCRIPT)
    command = {
        "script": [sys.executable, str(package / "app.py")],
        "module": [sys.executable, "-m", "pkg.app"],
        "import": [sys.executable, "-c", "import pkg.app"],
    }[how]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, check=True, env=env
    )
    assert result.stdout.strip() == "pkg.app.charge"


class _SettlingFails:
    """A store whose release and fail raise a StoreError that is neither unavailable nor lost."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _refuse(self) -> None:
        raise oncely.StoreError("the store answered nonsense", backend="test")

    def release(self, key: str, token: int) -> Any:
        self._refuse()

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> Any:
        self._refuse()

    async def arelease(self, key: str, token: int) -> Any:
        self._refuse()

    async def afail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> Any:
        self._refuse()


def _chained_store_error(exc: BaseException) -> bool:
    return isinstance(exc.__context__, oncely.StoreError) and "nonsense" in str(exc.__context__)


def test_a_settling_error_never_hides_the_functions_own_exception(store: Store) -> None:
    """The caller sees what the function raised; the store's error is chained to it."""
    failing = _SettlingFails(store)

    def effect(k: str) -> None:
        if k == "final":
            raise CardDeclined("no", 5)
        raise ConnectionError("bank timed out")

    @oncely.idempotent(store=failing, key="k", final_errors=(CardDeclined,))  # type: ignore[arg-type]
    def op(k: str) -> None:
        effect(k)

    @oncely.idempotent(store=failing, key="k", final_errors=(CardDeclined,))  # type: ignore[arg-type]
    async def aop(k: str) -> None:
        effect(k)

    for key, error in (("retry", ConnectionError), ("final", CardDeclined)):
        with pytest.raises(error) as info:
            op(key)
        assert _chained_store_error(info.value)
        with pytest.raises(error) as ainfo:
            asyncio.run(aop(key))
        assert _chained_store_error(ainfo.value)


class _SlowToStop:
    """A store whose first extend hangs, and when cancelled takes until `let_go` to end."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.extending = asyncio.Event()
        self.stopping = asyncio.Event()
        self.let_go = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> Any:
        if self.extending.is_set():
            return await self.inner.aextend(key, token, lease=lease)
        self.extending.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.stopping.set()
            await self.let_go.wait()
            raise


def test_cancelling_the_caller_while_its_heartbeat_stops_is_not_swallowed(store: Store) -> None:
    """A cancellation landing while the heartbeat is drained reaches the caller."""
    calls = []

    async def main() -> None:
        slow = _SlowToStop(store)

        @oncely.idempotent(store=slow, key="k", lease=0.6, ttl=60)  # type: ignore[arg-type]
        async def op(k: str) -> str:
            calls.append(k)
            await slow.extending.wait()  # the heartbeat task has an extend in flight
            return "done"

        task = asyncio.create_task(op("a"))
        await slow.stopping.wait()  # completed; the heartbeat is being stopped
        task.cancel()
        await asyncio.sleep(0)
        slow.let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await op("a") == "done"  # it was completed before the cancellation

    asyncio.run(main())
    assert calls == ["a"]


class _CompleteHangs:
    """A store whose first complete waits for `go` before it reaches the store."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.completing = asyncio.Event()
        self.go = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def acomplete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> Any:
        self.completing.set()
        await self.go.wait()
        return await self.inner.acomplete(key, token, result, ttl=ttl)


def test_cancelling_the_caller_during_complete_still_records_the_result() -> None:
    """The function returned: a cancellation during complete must not leave it to run again."""
    clock = FrozenClock()
    calls = []

    async def main() -> None:
        hangs = _CompleteHangs(MemoryStore(clock=clock))

        @oncely.idempotent(store=hangs, key="k", lease=1, ttl=60)  # type: ignore[arg-type]
        async def charge(k: str) -> str:
            calls.append(k)
            return "charged"

        task = asyncio.create_task(charge("a"))
        await hangs.completing.wait()
        task.cancel()
        await asyncio.sleep(0)
        hangs.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        clock.advance(timedelta(seconds=5))  # the lease is long gone
        assert await charge("a") == "charged"

    asyncio.run(main())
    assert calls == ["a"]


def _shapes(a: str, b: int = 2, *, c: str = "c", d: int) -> None: ...


def _variadic(a: str, /, b: int = 2, *rest: int, **extra: int) -> None: ...


@pytest.mark.parametrize(
    ("fn", "args", "kwargs"),
    [
        (_shapes, ("k",), {"d": 4}),
        (_shapes, ("k", 3), {"d": 4, "c": "x"}),
        (_shapes, (), {"a": "k", "d": 4}),
        (_shapes, (), {"d": 4, "b": 5, "a": "k"}),
        (_variadic, ("k",), {}),
        (_variadic, ("k", 3, 4, 5), {"z": 1}),
    ],
)
def test_arguments_are_read_as_bind_reads_them(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    plan = oncely.idempotent(store=MemoryStore(), key="a")(fn)._oncely_plan  # type: ignore[attr-defined]
    bound = plan.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    assert plan.arguments(args, kwargs) == bound.arguments
    assert plan.call_arguments(plan.arguments(args, kwargs)) == (bound.args, bound.kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {"d": 4}),  # a missing argument
        (("k",), {}),  # a missing keyword-only argument
        (("k",), {"d": 4, "a": "k"}),  # twice
        (("k",), {"d": 4, "e": 5}),  # unexpected
        (("k", 2, "c"), {"d": 4}),  # too many positional
    ],
)
def test_a_call_bind_refuses_raises_its_type_error(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    plan = oncely.idempotent(store=MemoryStore(), key="a")(_shapes)._oncely_plan  # type: ignore[attr-defined]
    with pytest.raises(TypeError) as expected:
        plan.signature.bind(*args, **kwargs)
    with pytest.raises(TypeError) as raised:
        plan.arguments(args, kwargs)
    assert str(raised.value) == str(expected.value)


def test_with_key_takes_its_key_by_name() -> None:
    runs: list[str] = []

    @oncely.idempotent(store=MemoryStore(), key="payment_id", fingerprint=None)
    def charge(payment_id: str) -> str:
        runs.append(payment_id)
        return payment_id

    @oncely.idempotent(store=MemoryStore(), key="payment_id")
    async def acharge(payment_id: str) -> str:
        return payment_id

    assert charge.with_key(key="explicit")("p-1") == "p-1"
    assert charge.with_key(key="explicit")("p-2") == "p-1"  # the explicit key replays
    assert runs == ["p-1"]
    assert asyncio.run(acharge.with_key(key="explicit")("p-1")) == "p-1"
