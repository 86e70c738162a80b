"""What the batch and grouping paths ask of the consumer that runs them (`IdempotentConsumer`),
written down so that they need not import it: the consumer imports them, never the reverse."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Protocol

from oncely import _execution
from oncely._core.codec import Codec
from oncely._core.flow import Flow
from oncely._core.policy import Policy
from oncely.consumers._verdicts import ConsumerPolicy, Delivery, Verdict
from oncely.stores._coalescing import CoalescingStore

__all__ = ["Running"]


class Running(Protocol):
    """The consumer as its batch and grouping paths see it."""

    store: Any
    policy: ConsumerPolicy
    codec: Codec
    _policy: Policy
    _takes_ops: bool | None

    def key_for(self, delivery: Delivery) -> str: ...
    def fingerprint_for(self, delivery: Delivery) -> str: ...
    def _verdict(self, verdict: Verdict) -> Verdict: ...
    def _retry_delay(self, limit: timedelta | None = None) -> timedelta: ...
    def _claimed(
        self, key: str, answer: object
    ) -> tuple[Verdict | None, _execution.Lease | None]: ...
    def _claim_many(self, requests: list[tuple[str, str]]) -> Flow[list[Any]]: ...
    def _unusable(self, exc: Exception) -> Verdict: ...
    def _failed(self, key: str, attempt: int, exc: Exception) -> Verdict: ...
    def _settle_failure(
        self, lease: _execution.Lease, verdict: Verdict, exc: Exception
    ) -> Flow[None]: ...
    def _release(self, lease: _execution.Lease) -> Flow[None]: ...
    def _calls_to(self, store: Any) -> CoalescingStore: ...
    async def _arun_acquired(
        self, coalescing: Any, lease: _execution.Lease, handler: Callable[[], Awaitable[Any]]
    ) -> Verdict: ...
