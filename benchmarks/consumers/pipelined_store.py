"""A prototype of the batch verbs on the Redis store, for the consumer benchmark only.

`oncely.consumers.IdempotentConsumer.batch_flow` claims and completes a fetched batch in one
call each when the store has ``claim_many``/``complete_many`` and their async twins
(`oncely.consumers.BATCH_VERBS`). The built-in stores do not have them yet; this subclass
shows what they cost on Redis: the store's own ``claim.lua`` and ``complete.lua``, wrapped in a
loop over the batch's keys, so a batch is ONE EVALSHA (one round trip, one command for
redis-py to pack and parse). Each item is still its own transition; the batch is not
all-or-nothing in meaning, though Redis runs the whole script atomically. The keys of one call
must share a slot on Redis Cluster: a cluster store would group them by slot (or pipeline the
single-key scripts). It reaches into the store's private parts and is not a supported API; the
proposal for the real one is in ``benchmarks/consumers/README.md``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from oncely import ClaimResult, LeaseLost
from oncely._core.flow import Flow
from oncely.errors import OncelyError
from oncely.stores.redis import RedisStore, _scripts

_LOOP = """
local keys, args = {}, {}
for i = 1, #KEYS do keys[i] = KEYS[i] end
for i = 1, #ARGV do args[i] = ARGV[i] end
local out = {}
for i = 1, #keys do
  KEYS[1] = keys[i]
  ARGV[1], ARGV[2], ARGV[3] = args[3 * i - 2], args[3 * i - 1], args[3 * i]
  out[i] = one()
end
return out
"""


@functools.cache
def _batch_sources() -> dict[str, str]:
    """claim.lua and complete.lua as ``one()``, run for each (KEYS[i], 3 ARGV) of a batch."""
    out = {}
    for name in ("claim", "complete"):
        source = _scripts.sources()[name]
        shared, _, own = source.partition(f"\n-- {name}.lua")
        out[name] = f"{shared}\nlocal function one()\n-- {name}.lua{own}\nend\n{_LOOP}"
    return out


class PipelinedRedisStore(RedisStore):
    """`RedisStore` plus ``claim_many``, ``complete_many`` and their async twins."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_scripts: dict[Any, dict[str, Any]] = {}

    def _scripts_for(self, client: Any) -> dict[str, Any]:
        scripts = self._batch_scripts.get(id(client))
        if scripts is None:
            sources = _batch_sources()
            scripts = {name: client.register_script(text) for name, text in sources.items()}
            self._batch_scripts[id(client)] = scripts
        return scripts

    @staticmethod
    def _prepare(flows: list[Flow[Any]]) -> tuple[str, list[bytes], list[Any]]:
        calls = [next(flow) for flow in flows]
        keys = [call.record for call in calls]
        args = [arg for call in calls for arg in call.args]
        return calls[0].script, keys, args

    @staticmethod
    def _decode(flows: list[Flow[Any]], replies: list[Any]) -> list[Any]:
        out: list[Any] = []
        for flow, reply in zip(flows, replies, strict=True):
            try:
                flow.send(reply)
            except StopIteration as done:
                out.append(done.value)
            except OncelyError as exc:  # a corrupt record: this item's own failure
                out.append(exc)
        return out

    def _batch(self, flows: list[Flow[Any]]) -> list[Any]:
        if not flows:
            return []
        script, keys, args = self._prepare(flows)
        with self._translate_errors(keys[0].decode()):
            self._check_open()
            self._sync_scripts()  # makes the client
            replies = self._scripts_for(self._client)[script](keys=keys, args=args)
        return self._decode(flows, replies)

    async def _abatch(self, flows: list[Flow[Any]]) -> list[Any]:
        if not flows:
            return []
        script, keys, args = self._prepare(flows)
        with self._translate_errors(keys[0].decode()):
            self._check_open()
            await self._async_scripts()  # makes this loop's client
            client = self._loops[asyncio.get_running_loop()].client
            replies = await self._scripts_for(client)[script](keys=keys, args=args)
        return self._decode(flows, replies)

    def claim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[ClaimResult]:
        """Claim every (key, fingerprint): one round trip."""
        return self._batch([_scripts.claim(self._space, k, fp, lease, ttl) for k, fp in requests])

    def complete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | None]:
        """Complete every (key, token, result): one round trip."""
        return self._batch(
            [_scripts.finish(self._space, "complete", k, t, r, ttl) for k, t, r in items]
        )

    async def aclaim_many(
        self, requests: Sequence[tuple[str, str]], *, lease: timedelta, ttl: timedelta
    ) -> list[ClaimResult]:
        """Async `claim_many`."""
        return await self._abatch(
            [_scripts.claim(self._space, k, fp, lease, ttl) for k, fp in requests]
        )

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[LeaseLost | None]:
        """Async `acomplete_many`."""
        return await self._abatch(
            [_scripts.finish(self._space, "complete", k, t, r, ttl) for k, t, r in items]
        )
