"""Guard: explicit claim / complete / fail / release around a block, sync and async."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely import (
    ConfigurationError,
    FingerprintMismatchError,
    Guard,
    InProgressError,
    LeaseLostError,
    OncelyError,
    Status,
    Store,
)
from oncely._core.keys import scope_key
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


class Refused(Exception):
    pass


def test_first_run_holds_lease_and_token(store: Store) -> None:
    """Entering acquires the lease; token and attempt are exposed; complete stores the value."""
    with Guard(store, "refund-1", fingerprint={"amount": 5}) as guard:
        assert not guard.replayed
        assert guard.token == 1
        assert guard.attempt == 1
        assert not guard.recovered
        guard.complete({"refund": "r-1"})
    with Guard(store, "refund-1", fingerprint={"amount": 5}) as again:
        assert again.replayed
        assert again.result == {"refund": "r-1"}


def test_block_that_returns_without_complete_is_completed(store: Store) -> None:
    """A block that ran to its end is completed (with None), never released."""
    with Guard(store, "k"):
        pass
    with Guard(store, "k") as guard:
        assert guard.replayed
        assert guard.result is None


def test_exception_releases_and_final_error_is_stored(store: Store) -> None:
    """Leaving by an ordinary exception releases; a final one is stored and replayed."""
    with pytest.raises(KeyError), Guard(store, "k"):
        raise KeyError("x")
    with Guard(store, "k") as retried:
        assert not retried.replayed
        assert retried.attempt == 2
        assert retried.token == 2
        retried.release()
    with pytest.raises(Refused), Guard(store, "f", final_errors=(Refused,)):
        raise Refused("no")
    with Guard(store, "f", final_errors=(Refused,)) as guard:
        assert guard.replayed
        with pytest.raises(Refused):
            _ = guard.result


def test_completing_with_an_unstorable_value_is_an_error_at_once(store: Store) -> None:
    """complete() with a value the codec cannot store raises ResultUnavailableError at once
    (the codec's error chained), as every replay does; the block never runs again."""
    with (
        pytest.raises(oncely.ResultUnavailableError, match="took effect once") as first,
        Guard(store, "u") as guard,
    ):
        guard.complete(threading.Lock())
    assert first.value.__cause__ is not None
    with Guard(store, "u") as again:
        assert again.replayed
        with pytest.raises(oncely.ResultUnavailableError):
            _ = again.result


def test_explicit_fail_and_release(store: Store) -> None:
    """fail() with a final error stores it; release() lets the next claim run."""
    with Guard(store, "a", scope="guard", final_errors=(Refused,)) as guard:
        guard.fail(Refused("declined"))
    record = store.get("guard|a")
    assert record is not None
    assert record.status is Status.FAILED
    with Guard(store, "b", scope="guard") as guard:
        guard.release()
    record = store.get("guard|b")
    assert record is not None
    assert record.status is Status.RELEASED


def test_settling_twice_is_an_error(store: Store) -> None:
    """A guard settles once."""
    with Guard(store, "k") as guard:
        guard.complete(1)
        with pytest.raises(OncelyError, match="already settled"):
            guard.complete(2)


def test_concurrent_duplicate_and_mismatch(store: Store) -> None:
    """A live lease gives InProgressError; another fingerprint gives FingerprintMismatchError."""
    with Guard(store, "k", fingerprint=1):
        with pytest.raises(InProgressError), Guard(store, "k", fingerprint=1):
            pass
        with pytest.raises(FingerprintMismatchError), Guard(store, "k", fingerprint=2):
            pass


def test_replayed_guard_has_no_token(store: Store) -> None:
    """A replaying guard holds no lease: token access is an error, not a silent 0."""
    with Guard(store, "k"):
        pass
    with Guard(store, "k") as guard, pytest.raises(OncelyError):
        _ = guard.token


def test_heartbeat_keeps_the_lease_while_the_block_runs(store: Store) -> None:
    """With a lease shorter than the block, others still find it in progress."""
    with Guard(store, "k", lease=0.5, ttl=60) as guard:  # two leases' worth of probes
        for _ in range(4):
            threading.Event().wait(0.25)
            with pytest.raises(InProgressError), Guard(store, "k", lease=0.5, ttl=60):
                pass
        assert not guard.lease_lost


def test_lease_lost_is_reported() -> None:
    """A block whose lease was taken over raises LeaseLostError on completion."""
    clock = FrozenClock()
    store = MemoryStore(clock=clock)
    with pytest.raises(LeaseLostError), Guard(store, "k", lease=1, heartbeat=False) as guard:
        clock.advance(timedelta(seconds=5))
        with Guard(store, "k", lease=1, heartbeat=False) as thief:
            assert thief.recovered
            assert thief.token == guard.token + 1
    assert guard.lease_lost


def test_async_guard(store: Store) -> None:
    """async with: the same behaviour through the async verbs."""

    async def main() -> None:
        async with Guard(store, "k", fingerprint="x") as guard:
            assert guard.token == 1
            await guard.acomplete([1, 2])
        async with Guard(store, "k", fingerprint="x") as again:
            assert again.replayed
            assert again.result == [1, 2]
        with pytest.raises(ValueError):
            async with Guard(store, "e"):
                raise ValueError
        async with Guard(store, "e") as retried:
            assert retried.attempt == 2
            await retried.arelease()
        async with Guard(store, "f", final_errors=(Refused,)) as failing:
            await failing.afail(Refused("x"))

    asyncio.run(main())


def test_async_with_on_sync_only_store_is_a_configuration_error(store: Store) -> None:
    """A store without async verbs cannot be used with `async with`."""

    async def main() -> None:
        async with Guard(SyncOnlyStore(store), "k"):
            pass

    with pytest.raises(ConfigurationError):
        asyncio.run(main())


def test_invalid_key_never_reaches_the_store() -> None:
    """Guard validates its key up front."""
    with pytest.raises(oncely.InvalidKeyError):
        Guard(MemoryStore(), "bad\nkey")


class _ReleaseFails:
    """A store whose release raises a StoreError that is neither unavailable nor lease lost."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def release(self, key: str, token: int) -> Any:
        raise oncely.StoreError("the store answered nonsense", backend="test")

    async def arelease(self, key: str, token: int) -> Any:
        raise oncely.StoreError("the store answered nonsense", backend="test")


def test_a_release_error_never_hides_the_blocks_own_exception(store: Store) -> None:
    """Leaving by an exception: the caller sees it, with the store's error chained."""
    failing = _ReleaseFails(store)
    with pytest.raises(KeyError) as info, Guard(failing, "k"):  # type: ignore[arg-type]
        raise KeyError("x")
    assert isinstance(info.value.__context__, oncely.StoreError)

    async def main() -> None:
        async with Guard(failing, "a"):  # type: ignore[arg-type]
            raise KeyError("y")

    with pytest.raises(KeyError) as ainfo:
        asyncio.run(main())
    assert isinstance(ainfo.value.__context__, oncely.StoreError)


def test_cancelling_during_guard_exit_reaches_the_caller(store: Store) -> None:
    """async with: a cancellation while the heartbeat is stopped is raised, not swallowed."""

    class SlowToStop:
        def __init__(self) -> None:
            self.extending = asyncio.Event()
            self.stopping = asyncio.Event()
            self.let_go = asyncio.Event()

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        async def aextend(self, key: str, token: int, *, lease: timedelta) -> Any:
            self.extending.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.stopping.set()
                await self.let_go.wait()
                raise

    async def main() -> None:
        slow = SlowToStop()

        async def block() -> None:
            async with Guard(slow, "k", scope="op", lease=0.6, ttl=60):  # type: ignore[arg-type]
                await slow.extending.wait()

        task = asyncio.create_task(block())
        await slow.stopping.wait()
        task.cancel()
        await asyncio.sleep(0)
        slow.let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with Guard(store, "k", scope="op") as again:
            assert again.replayed

    asyncio.run(main())


def _refund(store: Store, key: str) -> Any:
    with Guard(store, key) as guard:
        if guard.replayed:
            return guard.result
        guard.complete("refunded")
        return "refunded"


def _ship(store: Store, key: str) -> Any:
    with Guard(store, key) as guard:
        if guard.replayed:
            return guard.result
        guard.complete("shipped")
        return "shipped"


def test_guards_in_two_functions_do_not_share_a_key(store: Store) -> None:
    """Without scope=, each call site is its own scope: one key in two functions is two runs."""
    assert _refund(store, "order-7") == "refunded"
    assert _ship(store, "order-7") == "shipped"
    assert _refund(store, "order-7") == "refunded"


def test_the_derived_scope_is_the_call_sites_module_and_qualified_name(store: Store) -> None:
    """The scope is stable: the same call site always derives the same stored key."""
    guard = Guard(store, "k")
    this = test_the_derived_scope_is_the_call_sites_module_and_qualified_name
    assert guard.key == scope_key(f"{__name__}.{this.__qualname__}", "k")
    assert Guard(store, "k", scope="billing").key == "billing|k"


def test_int_and_uuid_keys_are_accepted(store: Store) -> None:
    """A guard takes the same key types as the decorator: str, int and UUID (not bool)."""
    order = uuid.UUID("8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert Guard(store, order, scope="s").key == f"s|{order}"
    assert Guard(store, 7, scope="s").key == "s|7"
    with pytest.raises(oncely.InvalidKeyError):
        Guard(store, True, scope="s")  # a bool is a mistake, not a key
