"""Stores that run the reference state machine inside an atomic section of their own.

The memory store's atomic section is a lock; the SQLite store's is an immediate transaction.
Either way the record is read, `oncely._core.machine` decides, and the change is written before
the section ends, so each transition is atomic and the table has one implementation.
"""

from __future__ import annotations

import functools
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from oncely._core import machine
from oncely._core.clock import Clock, SystemClock
from oncely._core.records import (
    Acquired,
    ClaimResult,
    LeaseLost,
    Record,
    Replay,
    Status,
    StoreHealth,
)
from oncely.errors import ConflictError, CorruptRecordError, StoreError
from oncely.stores import _namespace
from oncely.stores._batch import check_ops

__all__ = ["MachineStore", "Step", "in_progress_refusal"]

T = TypeVar("T")

Step = Callable[[Record | None, str | None, int], tuple[Record | None, str | None, T]]
"""Given the record as found, the call id kept with it (see `_claim_step`) and the clock's
time: the record to write (``None``: leave it as it is), the call id to keep with it, and the
answer."""

Decide = Callable[[Record | None, int], tuple[Record | None, T]]
"""A transition that neither reads nor writes the call id kept with the record."""


_MILLISECOND = timedelta(milliseconds=1)


@functools.lru_cache(maxsize=256)  # a program passes the same few leases and ttls on every call
def _ms(duration: timedelta) -> int:
    """*duration* in whole milliseconds, at least one."""
    return max(1, duration // _MILLISECOND)


def _claim_step(
    stored: str, fingerprint: str, lease_ms: int, ttl_ms: int, op: str | None = None
) -> Step[ClaimResult]:
    """A claim. *op*, the call id of a batch claim, is kept with the lease it takes (``op``, or
    ``op + "+"`` for a takeover), as the Redis and PostgreSQL stores keep theirs: the same claim
    sent again after its answer was lost finds its own lease and answers as the first send did.
    A claim without one keeps none (nothing could send it again)."""

    def step(
        record: Record | None, found: str | None, now_ms: int
    ) -> tuple[Record | None, str | None, ClaimResult]:
        if (
            op is not None
            and found is not None
            and record is not None
            and record.status is Status.IN_PROGRESS
            and record.is_live(now_ms)
            and record.fingerprint == fingerprint
            and found in (op, op + "+")
        ):
            # This very call ran already: answer as it did.
            return None, found, Acquired(record.token, found != op, record.attempt)
        new, answer = machine.claim(
            stored, record, fingerprint, now_ms=now_ms, lease_ms=lease_ms, ttl_ms=ttl_ms
        )
        if isinstance(answer, Acquired):
            return new, None if op is None else op + ("+" if answer.recovered else ""), answer
        return new, found, answer

    return step


def _keeping_op(decide: Decide[T]) -> Step[T]:
    """*decide* as a step that leaves the call id kept with the record as it is."""

    def step(
        record: Record | None, found: str | None, now_ms: int
    ) -> tuple[Record | None, str | None, T]:
        new, answer = decide(record, now_ms)
        return new, found, answer

    return step


def _complete_step(token: int, result: bytes, ttl_ms: int) -> Step[LeaseLost | None]:
    outcome = bytes(result)

    def decide(record: Record | None, now_ms: int) -> tuple[Record | None, LeaseLost | None]:
        return machine.complete(record, token, outcome, now_ms=now_ms, ttl_ms=ttl_ms)

    return _keeping_op(decide)


def in_progress_refusal(key: str) -> ConflictError:
    """What ``forget`` raises for an in-progress record without ``force``."""
    return ConflictError(
        f"{key!r} is in progress and its worker may still be running: forget it with "
        "force=True (oncely forget --force) only once that worker is known to be gone",
        key=key,
    )


def _forget_step(force: bool) -> Step[tuple[Status | None, bool]]:
    def decide(
        record: Record | None, now_ms: int
    ) -> tuple[Record | None, tuple[Status | None, bool]]:
        if record is None or not record.is_live(now_ms) or record.status is Status.RELEASED:
            return None, (None, False)
        if record.status is Status.IN_PROGRESS and not force:
            return None, (None, True)
        tombstone = replace(
            record,
            status=Status.RELEASED,
            result=None,
            lease_expires_at_ms=min(record.lease_expires_at_ms, now_ms),
            updated_at_ms=now_ms,
        )
        return tombstone, (record.status, False)

    return _keeping_op(decide)


class MachineStore:
    """Implements every verb of `oncely.Store` over one `_atomic` primitive.

    Subclasses provide `_atomic(key, step)`, which reads the record of *key* and the call id
    kept with it, calls ``step(record, op, now_ms)`` and writes the record and the call id it
    returns (if the record is not ``None``) atomically, and `_read(key)`; `_atomic_many` runs
    several steps in one section where the store can (by default one `_atomic` each). Async
    verbs run the same code through `_run_async`, which by default calls it inline (right for
    stores that never block).
    """

    backend = "machine"

    def __init__(self, *, namespace: str = "", clock: Clock | None = None) -> None:
        self.namespace = namespace
        self.clock: Clock = clock or SystemClock()

    # -- primitives for subclasses -------------------------------------------------------------

    def _atomic(self, key: str, step: Step[T]) -> T:
        raise NotImplementedError

    def _read(self, key: str) -> Record | None:
        raise NotImplementedError

    def _atomic_many(self, steps: Sequence[tuple[str, Step[T]]]) -> list[T | StoreError]:
        """Run each ``(key, step)`` as `_atomic` would, in order; a corrupt record answers
        `CorruptRecordError` in its own place."""
        answers: list[T | StoreError] = []
        for key, step in steps:
            try:
                answers.append(self._atomic(key, step))
            except CorruptRecordError as exc:
                answers.append(exc)
        return answers

    async def _run_async(self, call: Callable[[], T]) -> T:
        return call()

    def _stored_key(self, key: str) -> str:
        return _namespace.stored_key(self.namespace, key)

    # -- sync verbs --------------------------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`."""
        stored = self._stored_key(key)
        step = _claim_step(stored, fingerprint, _ms(lease), _ms(ttl))
        answer: ClaimResult = self._unscoped(self._atomic(stored, step))
        return answer

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`."""
        return self._atomic(self._stored_key(key), _complete_step(token, result, _ms(ttl)))

    def claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.claim_many`: one atomic section for the whole batch.

        *ops*, one per request, are the claims' call ids: a batch sent again with the same
        ids, after an answer that never came, gets its own applied claims back as `Acquired`
        (not `InProgress`)."""
        lease_ms, ttl_ms = _ms(lease), _ms(ttl)
        each: Sequence[str | None] = [None] * len(requests) if ops is None else ops
        check_ops(requests, each)
        steps = []
        for (key, fingerprint), op in zip(requests, each, strict=True):
            stored = self._stored_key(key)
            steps.append((stored, _claim_step(stored, fingerprint, lease_ms, ttl_ms, op)))
        return [self._unscoped(answer) for answer in self._atomic_many(steps)] if steps else []

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.complete_many`: one atomic section for the whole batch."""
        ttl_ms = _ms(ttl)
        steps = [
            (self._stored_key(key), _complete_step(token, result, ttl_ms))
            for key, token, result in items
        ]
        return self._atomic_many(steps) if steps else []

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.fail`."""
        return self._atomic(
            self._stored_key(key),
            _keeping_op(
                lambda record, now_ms: machine.fail(
                    record, token, bytes(error), now_ms=now_ms, ttl_ms=_ms(ttl)
                )
            ),
        )

    def release(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.SyncStore.release`."""
        return self._atomic(
            self._stored_key(key),
            _keeping_op(lambda record, now_ms: machine.release(record, token, now_ms=now_ms)),
        )

    def extend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.extend`."""
        return self._atomic(
            self._stored_key(key),
            _keeping_op(
                lambda record, now_ms: machine.extend(
                    record, token, now_ms=now_ms, lease_ms=_ms(lease)
                )
            ),
        )

    def get(self, key: str) -> Record | None:
        """See `oncely.SyncStore.get`."""
        record = self._read(self._stored_key(key))
        if record is None or not record.is_live(self.clock.now_ms()):
            return None
        return typing.cast(Record, self._unscoped(record))

    def _unscoped(self, value: Any) -> Any:
        # Records leave the store with the caller's key, not the namespaced one.
        if isinstance(value, Replay):
            record = self._unscoped(value.record)
            return value if record is value.record else replace(value, record=record)
        if isinstance(value, Record):
            key = _namespace.caller_key(self.namespace, value.key)
            return value if key == value.key else replace(value, key=key)
        return value

    # -- async verbs -------------------------------------------------------------------------

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`."""
        return await self._run_async(
            functools.partial(self.claim, key, fingerprint, lease=lease, ttl=ttl)
        )

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`."""
        return await self._run_async(functools.partial(self.complete, key, token, result, ttl=ttl))

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `claim_many`."""
        if not requests:
            return []
        return await self._run_async(
            functools.partial(self.claim_many, requests, lease=lease, ttl=ttl, ops=ops)
        )

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.acomplete_many`."""
        if not items:
            return []
        return await self._run_async(functools.partial(self.complete_many, items, ttl=ttl))

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.afail`."""
        return await self._run_async(functools.partial(self.fail, key, token, error, ttl=ttl))

    async def arelease(self, key: str, token: int) -> LeaseLost | None:
        """See `oncely.AsyncStore.arelease`."""
        return await self._run_async(functools.partial(self.release, key, token))

    async def aextend(self, key: str, token: int, *, lease: timedelta) -> LeaseLost | None:
        """See `oncely.AsyncStore.aextend`."""
        return await self._run_async(functools.partial(self.extend, key, token, lease=lease))

    async def aget(self, key: str) -> Record | None:
        """See `oncely.AsyncStore.aget`."""
        return await self._run_async(functools.partial(self.get, key))

    def forget(self, key: str, *, force: bool = False) -> Status | None:
        """Make the next claim of *key* run the operation again: its finished record becomes a
        released tombstone that keeps its fencing token (and drops its result) until it expires.

        Returns:
            The status the record had, or ``None`` when *key* had no live record (or only a
            tombstone).

        Raises:
            ConflictError: The record is in progress and *force* is not set (with *force*, its
                lease ends: the worker holding it gets a lost lease when it settles).
        """
        status, refused = self._atomic(self._stored_key(key), _forget_step(force))
        if refused:
            raise in_progress_refusal(key)
        return status

    async def aforget(self, key: str, *, force: bool = False) -> Status | None:
        """Async `forget`."""
        return await self._run_async(functools.partial(self.forget, key, force=force))

    def _schema_version(self) -> int | None:
        """The schema version the store holds (``None``: it has none); raise if it cannot serve."""
        return None

    def check(self) -> StoreHealth:
        """See `oncely.CheckableStore.check`."""
        started = time.perf_counter()
        version = self._schema_version()
        return StoreHealth(self.backend, version, (time.perf_counter() - started) * 1000)

    async def acheck(self) -> StoreHealth:
        """See `oncely.CheckableStore.acheck`."""
        return await self._run_async(self.check)

    def close(self) -> None:
        """Release resources; the store cannot be used afterwards."""

    async def aclose(self) -> None:
        """See `close`."""
        await self._run_async(self.close)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self: _S) -> _S:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


_S = TypeVar("_S", bound=MachineStore)
