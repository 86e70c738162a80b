"""`BloomStore`: keys remembered past their records' ttl, at about 1.5 bytes a key.

A record lives for its ttl; a duplicate that arrives later finds no record and runs again. For
high-volume streams whose duplicates can come late (a replayed partition, a producer retrying
after an outage) and whose records are too many to keep for as long, a `BloomStore` remembers
every completed key in a Bloom filter (`oncely.bloom`) beside its inner store:

- a claim always goes to the inner store (the lease is what makes a run happen at most once);
- when it acquires a key never seen *by the store* (first attempt, not a recovery), the filter
  is asked, with no store read: "certainly new" lets the run go ahead; "maybe seen" means the key
  completed before its record expired, so the lease is completed at once with a marker and the
  caller gets a `Replay` of it (consumers skip and acknowledge the duplicate; a decorated call
  raises `ResultUnavailableError`);
- a completion (or a declared failure) that lands adds the key to the filter.

The trade, stated: a new key the filter wrongly answers "maybe seen" for is treated as a late
duplicate and never runs, with probability about the filter's ``error_rate`` while it holds no
more than its ``capacity``. Never for payments; never the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from oncely._core.codec import encode_unavailable
from oncely._core.flow import Flow, adrive, drive
from oncely._core.protocols import Store
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Record,
    Replay,
    Status,
)
from oncely.errors import StoreError
from oncely.stores import _batch
from oncely.stores._wrapper import StoreWrapper

__all__ = ["BloomStore", "KeyFilter"]

LATE_DUPLICATE = "the key completed before its record expired (a Bloom filter remembers it)"
"""The reason a late duplicate's record gives for having no result."""

_RETRY = timedelta(seconds=1)

T = TypeVar("T")


class KeyFilter(Protocol):
    """What `BloomStore` needs of a filter: `oncely.bloom.BloomFilter` and `RedisBloomFilter`."""

    def add_many(self, keys: Sequence[str]) -> list[bool]: ...
    def might_contain_many(self, keys: Sequence[str]) -> list[bool]: ...
    async def aadd_many(self, keys: Sequence[str]) -> list[bool]: ...
    async def amight_contain_many(self, keys: Sequence[str]) -> list[bool]: ...


def _fresh(answer: object) -> bool:
    """An acquired key the store held no finished record of: absent, expired, released or
    forgotten (not a lease taken over from a worker that stopped, whose run never finished)."""
    return isinstance(answer, Acquired) and not answer.recovered


class BloomStore(StoreWrapper):
    """*inner* with late duplicates recognised by *filter* (see the module's docstring).

    Every verb but the claims and the completions is the inner store's own: note that
    ``forget`` cannot make a key run again, since a Bloom filter cannot forget one key.

    .. versionadded:: 0.1.0
    """

    backend = "bloom"

    def __init__(self, inner: Store, filter: KeyFilter) -> None:
        super().__init__(inner)
        self.filter = filter
        self.late_duplicates = 0
        """How many claims this store answered as late duplicates."""

    # -- the decision, once for sync and async -------------------------------------------------

    def _judge(
        self, keys: Sequence[str], answers: list[Any], lease: timedelta, ttl: timedelta
    ) -> Flow[list[Any]]:
        """Turn the fresh acquisitions among *answers* whose key the filter may have seen into
        replays of a completed, result-less record."""
        fresh = [index for index, answer in enumerate(answers) if _fresh(answer)]
        if not fresh:
            return answers
        seen = yield ("check", [keys[index] for index in fresh])
        marker = encode_unavailable(LATE_DUPLICATE)
        for index, maybe in zip(fresh, seen, strict=True):
            if not maybe:
                continue
            key = keys[index]
            self.late_duplicates += 1
            lost = yield ("complete", key, answers[index].token, marker, ttl)
            record = None if lost is not None else (yield ("get", key))
            if isinstance(record, Record) and record.status is Status.COMPLETED:
                answers[index] = Replay(record)
            else:  # taken over in between: the retry will find out what happened
                answers[index] = InProgress(retry_after=_RETRY)
        return answers

    def _perform(self, op: tuple[Any, ...]) -> Any:
        verb, *args = op
        if verb == "check":
            return self.filter.might_contain_many(args[0])
        if verb == "complete":
            key, token, result, ttl = args
            return self.inner.complete(key, token, result, ttl=ttl)
        return self.inner.get(args[0])

    async def _aperform(self, op: tuple[Any, ...]) -> Any:
        verb, *args = op
        if verb == "check":
            return await self.filter.amight_contain_many(args[0])
        if verb == "complete":
            key, token, result, ttl = args
            return await self.inner.acomplete(key, token, result, ttl=ttl)
        return await self.inner.aget(args[0])

    @staticmethod
    def _landed(keys: Sequence[str], answers: Sequence[object]) -> list[str]:
        return [key for key, answer in zip(keys, answers, strict=True) if answer is None]

    # -- sync verbs ----------------------------------------------------------------------------

    def claim(self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta) -> ClaimResult:
        """See `oncely.SyncStore.claim`; a fresh key the filter may have seen is a replay."""
        answer = self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)
        if not _fresh(answer):
            return answer
        judged: list[ClaimResult] = drive(self._judge([key], [answer], lease, ttl), self._perform)
        return judged[0]

    def claim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `oncely.BatchStore.claim_many`: one filter call for the batch's fresh keys."""
        answers = _batch.claim_many(self.inner, requests, lease=lease, ttl=ttl, ops=ops)
        keys = [key for key, _ in requests]
        judged: list[ClaimResult | StoreError] = drive(
            self._judge(keys, answers, lease, ttl), self._perform
        )
        return judged

    def complete(self, key: str, token: int, result: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.complete`; a completion that lands is remembered."""
        return self._remembered([key], [self.inner.complete(key, token, result, ttl=ttl)])[0]

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.complete_many`."""
        answers = _batch.complete_many(self.inner, items, ttl=ttl) if items else []
        return self._remembered([key for key, _, _ in items], answers)

    def fail(self, key: str, token: int, error: bytes, *, ttl: timedelta) -> LeaseLost | None:
        """See `oncely.SyncStore.fail`; a declared failure that lands is remembered."""
        return self._remembered([key], [self.inner.fail(key, token, error, ttl=ttl)])[0]

    def _remembered(self, keys: Sequence[str], answers: list[T]) -> list[T]:
        landed = self._landed(keys, answers)
        if landed:
            self.filter.add_many(landed)
        return answers

    # -- async verbs ---------------------------------------------------------------------------

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        """See `oncely.AsyncStore.aclaim`."""
        answer = await self.inner.aclaim(key, fingerprint, lease=lease, ttl=ttl)
        if not _fresh(answer):
            return answer
        judged: list[ClaimResult] = await adrive(
            self._judge([key], [answer], lease, ttl), self._aperform
        )
        return judged[0]

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[ClaimResult | StoreError]:
        """See `claim_many`."""
        answers = await _batch.aclaim_many(self.inner, requests, lease=lease, ttl=ttl, ops=ops)
        keys = [key for key, _ in requests]
        judged: list[ClaimResult | StoreError] = await adrive(
            self._judge(keys, answers, lease, ttl), self._aperform
        )
        return judged

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.acomplete`."""
        answer = await self.inner.acomplete(key, token, result, ttl=ttl)
        return (await self._aremembered([key], [answer]))[0]

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | StoreError | None]:
        """See `oncely.BatchStore.acomplete_many`."""
        answers = await _batch.acomplete_many(self.inner, items, ttl=ttl) if items else []
        return await self._aremembered([key for key, _, _ in items], answers)

    async def afail(
        self, key: str, token: int, error: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        """See `oncely.AsyncStore.afail`."""
        answer = await self.inner.afail(key, token, error, ttl=ttl)
        return (await self._aremembered([key], [answer]))[0]

    async def _aremembered(self, keys: Sequence[str], answers: list[T]) -> list[T]:
        landed = self._landed(keys, answers)
        if landed:
            await self.filter.aadd_many(landed)
        return answers
