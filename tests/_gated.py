"""A memory store whose claims are applied at once but answer late, when the test says so.

A caller cancelled while such a claim is in flight is the case of a slow store (a round trip
over a slow network): the lease is taken in the store, and only the reply is still to come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from oncely import ClaimResult
from oncely.stores.memory import MemoryStore


class GatedClaims(MemoryStore):
    """Each claim (or batch of claims) is applied, sets ``sent`` (and ``batch_sent``), then
    waits for ``gate`` (for a batch, ``batch_gate``) before it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()
        self.gate = asyncio.Event()
        self.batch_sent = asyncio.Event()
        self.batch_gate = asyncio.Event()

    async def aclaim(
        self, key: str, fingerprint: str, *, lease: timedelta, ttl: timedelta
    ) -> ClaimResult:
        answer = await super().aclaim(key, fingerprint, lease=lease, ttl=ttl)
        self.sent.set()
        await self.gate.wait()
        return answer

    async def aclaim_many(
        self,
        requests: Sequence[tuple[str, str]],
        *,
        lease: timedelta,
        ttl: timedelta,
        ops: Sequence[str] | None = None,
    ) -> list[Any]:
        answers = await super().aclaim_many(requests, lease=lease, ttl=ttl)
        self.sent.set()
        self.batch_sent.set()
        await self.batch_gate.wait()
        return answers

    def open(self) -> None:
        """Let every claim answer from now on."""
        self.gate.set()
        self.batch_gate.set()
