"""Activity (see `oncely.observe.activity`) in Redis: per-minute hashes and a capped list.

Every name carries the same hash tag, so on a cluster all of one namespace's activity lives on
one node and a flush is one pipeline to it. The names never match the store's record pattern
(``<prefix>{<namespace>:<key>}``), so ``scan`` and ``purge`` never see them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RedisActivity"]

_SEPARATOR = "\x1f"


class RedisActivity:
    """Activity in Redis, through a client of its own made like the store's."""

    def __init__(self, client: Any, prefix: str, namespace: str) -> None:
        self._client = client
        # Never an empty hash tag (``{}`` would hash the whole name: a slot per minute).
        tag = "activity|" + namespace.replace("{", "(").replace("}", ")")
        self._head = f"{prefix}activity:{{{tag}}}:"

    @classmethod
    def of(cls, store: Any) -> RedisActivity:
        """The activity of a `RedisStore` or `RedisClusterStore` (a new client: closed by
        `close`)."""
        space = getattr(store, "_space", None)
        prefix = getattr(space, "prefix", "oncely:")
        return cls(store._new_client(), prefix, store.namespace)

    def _minute(self, minute: int) -> str:
        return f"{self._head}m:{minute}"

    @property
    def _recent(self) -> str:
        return f"{self._head}recent"

    def write(
        self,
        counts: Mapping[tuple[int, str, str], int],
        recent: Sequence[tuple[int, str, str, str, str]],
        *,
        now_ms: int,
        keep_minutes: int,
        keep_recent: int,
    ) -> None:
        """See `oncely.observe.activity.Sink.write`: one pipeline."""
        pipe = self._client.pipeline(transaction=False)
        expiring: set[int] = set()
        for (minute, scope, kind), count in counts.items():
            pipe.hincrby(self._minute(minute), f"{scope}{_SEPARATOR}{kind}", count)
            expiring.add(minute)
        keep_seconds = (keep_minutes + 1) * 60
        for minute in expiring:
            pipe.expire(self._minute(minute), keep_seconds)
        if recent and keep_recent > 0:
            pipe.lpush(self._recent, *(json.dumps(list(row)) for row in recent))
            pipe.ltrim(self._recent, 0, keep_recent - 1)
            pipe.expire(self._recent, keep_seconds)
        pipe.execute()

    def read(
        self, *, since_minute: int, until_minute: int, limit: int
    ) -> tuple[list[tuple[int, str, str, int]], list[tuple[int, str, str, str, str]]]:
        """See `oncely.observe.activity.Sink.read`: one pipeline."""
        minutes = list(range(since_minute, until_minute + 1))
        pipe = self._client.pipeline(transaction=False)
        for minute in minutes:
            pipe.hgetall(self._minute(minute))
        if limit > 0:
            pipe.lrange(self._recent, 0, limit - 1)
        replies = pipe.execute()
        rows: list[tuple[int, str, str, int]] = []
        for minute, fields in zip(minutes, replies, strict=False):
            for name, count in fields.items():
                scope, _, kind = _text(name).rpartition(_SEPARATOR)
                rows.append((minute, scope, kind, int(count)))
        recent: list[tuple[int, str, str, str, str]] = []
        for item in replies[-1] if limit > 0 else []:
            at_ms, scope, surface, kind, reason = json.loads(_text(item))
            recent.append((int(at_ms), str(scope), str(surface), str(kind), str(reason)))
        return rows, recent

    def after_fork(self) -> None:
        """In a forked child: nothing to do, redis-py's pools reconnect in a new process."""

    def close(self) -> None:
        """Close the client."""
        self._client.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
