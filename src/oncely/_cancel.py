"""Async calls that a cancelled caller must not cut short: shielded calls and claims.

A store call in flight when its caller is cancelled may have been applied with only its reply
still to come. `shielded` lets a call that must land (a completion) end first; a claim's lease
is given back (`given_back_if_cancelled`), so a key is not left in progress for a whole lease
with nothing running under it. Used by the entry points' flows and by the coalescing layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from oncely._core.protocols import AsyncStore
from oncely._core.records import Acquired
from oncely._log import fields, get_logger

__all__ = ["give_back", "given_back_if_cancelled", "guards_itself", "release_unused", "shielded"]

logger = get_logger("oncely")

T = TypeVar("T")


def guards_itself(store: object) -> bool:
    """Whether *store*'s async claim, complete and fail need no task to shield them from a
    cancelled caller: its verbs never suspend (``memory://``), or they give a cancelled
    claim's lease back and land a cancelled finish themselves (``_cancel_safe``: the
    PostgreSQL and Redis stores, the coalescing view)."""
    kind = type(store)
    return (
        getattr(kind, "_inline_async", None) is kind or getattr(kind, "_cancel_safe", None) is kind
    )


async def shielded(call: Awaitable[T]) -> T:
    """Await *call* to its end even if this task is cancelled meanwhile, then be cancelled."""
    task = asyncio.ensure_future(call)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is None:
        return task.result()
    if not task.cancelled():
        task.exception()  # retrieved: what the caller sees is its cancellation
    raise cancelled


async def given_back_if_cancelled(
    claim: Awaitable[T], store: AsyncStore, key: str | Sequence[str]
) -> T:
    """Await *claim* of *key* (a batch claim of these keys); if the caller is cancelled while
    it is in flight, wait for its answer, release a lease it took (shielded), then be cancelled.

    The claim may have been applied with only its reply still to come: cancelling it would
    leave the key in progress for a whole lease, with nothing running under it. A store whose
    verbs never suspend (``memory://``) has no claim in flight to wait for, and one that
    `guards_itself` gives a cancelled caller's lease back itself: both are awaited as they are.
    """
    if guards_itself(store):
        return await claim
    task = asyncio.ensure_future(claim)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():  # the caller was cancelled, not the claim (its loop closing)
            await shielded(give_back(task, store, key))
        raise


async def give_back(
    claim: asyncio.Future[Any], store: AsyncStore, key: str | Sequence[str]
) -> None:
    """Release the leases *claim* of *key* (a batch claim of these keys) takes, once it
    answers (its caller was cancelled)."""
    await asyncio.wait((claim,))
    if claim.cancelled() or claim.exception() is not None:
        return  # nothing was taken, or it is not known: a lease taken expires on its own
    answer = claim.result()
    if isinstance(key, str):
        await release_unused(store, key, answer)
    else:
        for each, one in zip(key, answer, strict=False):
            await release_unused(store, each, one)


async def release_unused(store: AsyncStore, key: str, answer: object) -> None:
    """Release the lease of claim *answer* of *key* if it is `Acquired`: its caller was
    cancelled before it could run anything under it."""
    if type(answer) is not Acquired:
        return
    try:
        await store.arelease(key, answer.token)
    except Exception as exc:
        logger.warning(
            "could not release key=%s after its caller was cancelled: %s; it recovers after "
            "its lease",
            key,
            exc,
            extra=fields(key=key, token=answer.token, outcome="store_unavailable"),
        )
        return
    logger.info(
        "claim released key=%s: its caller was cancelled before it could run",
        key,
        extra=fields(key=key, token=answer.token, outcome="released"),
    )
