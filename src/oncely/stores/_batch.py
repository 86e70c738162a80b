"""The batch verbs for a store that lacks them: one call per item, answers in order.

`oncely.BatchStore` verbs answer a failing item in its own place; so do these, so that an
item acquired before another one failed is never lost to the caller.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from oncely._core.records import ClaimResult, LeaseLost
from oncely.errors import StoreError

__all__ = [
    "aclaim_many",
    "acomplete_many",
    "call_ids",
    "check_ops",
    "claim_many",
    "complete_many",
    "takes_ops",
]


def call_ids(requests: Sequence[object], ops: Sequence[str] | None) -> Sequence[str]:
    """The call ids of a batch claim's *requests*: *ops*, one per request, or new ones.

    Raises:
        ValueError: *ops* has another length than *requests*.
    """
    if ops is None:
        return [secrets.token_hex(8) for _ in requests]
    check_ops(requests, ops)
    return ops


def check_ops(requests: Sequence[object], ops: Sequence[str | None]) -> None:
    """Raise `ValueError` unless there is one call id in *ops* per request."""
    if len(ops) != len(requests):
        raise ValueError(f"ops has {len(ops)} ids for {len(requests)} requests")


def takes_ops(verb: Any) -> bool:
    """Whether a batch claim *verb* takes the claims' call ids (``ops=``): then a batch sent
    again with the same ids gets its own applied claims back as Acquired."""
    try:
        return "ops" in inspect.signature(verb).parameters
    except (TypeError, ValueError):
        return False


def claim_many(
    store: Any,
    requests: Sequence[tuple[str, str]],
    *,
    lease: timedelta,
    ttl: timedelta,
    ops: Sequence[str] | None = None,
) -> list[ClaimResult | StoreError]:
    """``store.claim_many`` (with the claims' call ids *ops* when given and it takes them), or
    a claim per request when the store has no batch verbs."""
    if hasattr(store, "claim_many"):
        extra = {"ops": ops} if ops is not None and takes_ops(store.claim_many) else {}
        answers: list[ClaimResult | StoreError] = store.claim_many(
            requests, lease=lease, ttl=ttl, **extra
        )
        return answers
    out: list[ClaimResult | StoreError] = []
    for key, fingerprint in requests:
        try:
            out.append(store.claim(key, fingerprint, lease=lease, ttl=ttl))
        except StoreError as exc:
            out.append(exc)
    return out


def complete_many(
    store: Any, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
) -> list[LeaseLost | StoreError | None]:
    """``store.complete_many``, or a completion per item when the store has no batch verbs."""
    if hasattr(store, "complete_many"):
        answers: list[LeaseLost | StoreError | None] = store.complete_many(items, ttl=ttl)
        return answers
    out: list[LeaseLost | StoreError | None] = []
    for key, token, result in items:
        try:
            out.append(store.complete(key, token, result, ttl=ttl))
        except StoreError as exc:
            out.append(exc)
    return out


async def aclaim_many(
    store: Any,
    requests: Sequence[tuple[str, str]],
    *,
    lease: timedelta,
    ttl: timedelta,
    ops: Sequence[str] | None = None,
) -> list[ClaimResult | StoreError]:
    """Async `claim_many`."""
    if hasattr(store, "aclaim_many"):
        extra = {"ops": ops} if ops is not None and takes_ops(store.aclaim_many) else {}
        answers: list[ClaimResult | StoreError] = await store.aclaim_many(
            requests, lease=lease, ttl=ttl, **extra
        )
        return answers
    out: list[ClaimResult | StoreError] = []
    for key, fingerprint in requests:
        try:
            out.append(await store.aclaim(key, fingerprint, lease=lease, ttl=ttl))
        except StoreError as exc:
            out.append(exc)
    return out


async def acomplete_many(
    store: Any, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
) -> list[LeaseLost | StoreError | None]:
    """Async `complete_many`."""
    if hasattr(store, "acomplete_many"):
        answers: list[LeaseLost | StoreError | None] = await store.acomplete_many(items, ttl=ttl)
        return answers
    out: list[LeaseLost | StoreError | None] = []
    for key, token, result in items:
        try:
            out.append(await store.acomplete(key, token, result, ttl=ttl))
        except StoreError as exc:
            out.append(exc)
    return out
