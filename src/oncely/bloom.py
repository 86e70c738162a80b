"""Bloom filters: remember which keys were seen, at about 1.5 bytes a key, with a stated error.

A Bloom filter answers "certainly new" or "maybe seen". "Certainly new" is always true; "maybe
seen" is wrong for a new key with probability about ``error_rate`` once ``capacity`` keys were
added (more past it). That trade suits high-volume streams whose duplicates may arrive after
their records expired, or whose every id is too costly to keep; never payments, and never the
default (docs/guides/consumers.md, *Deduplication at volume*).

- `BloomFilter`: in this process (the ``bloom`` extra: rbloom, a Rust filter).
- `RedisBloomFilter`: shared by every process, a bit array in one plain Redis string (no module
  needed) updated by one script, so test-and-set of a batch is atomic and Cluster-safe.

Both answer the same question with the same methods: ``add(key)`` says whether the key was
certainly new before it was added (so exactly one of several concurrent adders of a new key is
told so, in Redis), ``might_contain(key)`` only asks.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

from oncely._deps import require
from oncely.errors import ConfigurationError

__all__ = ["BloomFilter", "RedisBloomFilter", "bloom_size"]

_MAX_BITS = 2**32
"""A Redis string holds at most 512 MiB: 2**32 bits."""


def bloom_size(capacity: int, error_rate: float) -> tuple[int, int]:
    """The optimal bit count and number of hash functions for *capacity* keys at *error_rate*.

    Raises:
        ConfigurationError: *capacity* is not a positive int or *error_rate* not in (0, 1).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ConfigurationError(f"capacity must be an int >= 1, not {capacity!r}")
    if isinstance(error_rate, bool) or not isinstance(error_rate, (int, float)):
        raise ConfigurationError(f"error_rate must be a float in (0, 1), not {error_rate!r}")
    if not 0.0 < error_rate < 1.0:
        raise ConfigurationError(f"error_rate must be in (0, 1), not {error_rate!r}")
    bits = math.ceil(-capacity * math.log(error_rate) / math.log(2) ** 2)
    hashes = max(1, round(bits / capacity * math.log(2)))
    return bits, hashes


class BloomFilter:
    """A Bloom filter in this process, sized for *capacity* keys at *error_rate*.

    Not shared between processes and lost at exit: one per consumer process, in front of the
    shared store. Thread-safe for ``add`` and ``might_contain`` under the GIL.

    .. versionadded:: 0.1.0
    """

    __slots__ = ("_filter", "capacity", "error_rate")

    def __init__(self, capacity: int, error_rate: float = 0.001) -> None:
        bloom_size(capacity, error_rate)  # validate
        rbloom = require("rbloom", extra="bloom")
        self.capacity = capacity
        self.error_rate = float(error_rate)
        self._filter: Any = rbloom.Bloom(capacity, self.error_rate)

    @property
    def size_bytes(self) -> int:
        """The bit array's size in bytes."""
        return int(self._filter.size_in_bits) // 8

    def might_contain(self, key: str) -> bool:
        """``False``: *key* was certainly never added. ``True``: it maybe was."""
        return key in self._filter

    def add(self, key: str) -> bool:
        """Add *key*; return whether it was certainly new before."""
        bloom = self._filter
        if key in bloom:
            return False
        bloom.add(key)
        return True

    def add_many(self, keys: Iterable[str]) -> list[bool]:
        """`add` for each of *keys*, in order (a key repeated in *keys* is new only once)."""
        return [self.add(key) for key in keys]

    def might_contain_many(self, keys: Iterable[str]) -> list[bool]:
        """`might_contain` for each of *keys*, in order."""
        bloom = self._filter
        return [key in bloom for key in keys]

    async def aadd_many(self, keys: Iterable[str]) -> list[bool]:
        """`add_many` (it never waits: the filter is in memory)."""
        return self.add_many(keys)

    async def amight_contain_many(self, keys: Iterable[str]) -> list[bool]:
        """`might_contain_many` (it never waits: the filter is in memory)."""
        return self.might_contain_many(keys)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._filter

    def __repr__(self) -> str:
        return f"BloomFilter(capacity={self.capacity}, error_rate={self.error_rate})"


# One call adds or checks a batch. Positions come from the key's SHA-1 (double hashing: two
# 48-bit halves, exact in Lua's doubles), so every client and the server agree on them without
# sending them over the wire.
_SCRIPT = """
local bits = tonumber(ARGV[1])
local hashes = tonumber(ARGV[2])
local write = ARGV[3] == '1'
local out = {}
for n = 4, #ARGV do
  local digest = redis.sha1hex(ARGV[n])
  local h1 = tonumber(string.sub(digest, 1, 12), 16)
  local h2 = tonumber(string.sub(digest, 13, 24), 16)
  local new = 0
  for i = 0, hashes - 1 do
    local offset = (h1 + i * h2) % bits
    if redis.call('GETBIT', KEYS[1], offset) == 0 then
      new = 1
      if not write then break end
      redis.call('SETBIT', KEYS[1], offset, 1)
    end
  end
  out[#out + 1] = new
end
return out
"""


class RedisBloomFilter:
    """A Bloom filter shared through Redis: one string key *name* of `bloom_size` bits.

    *client* is a redis-py client: sync (``redis.Redis``, ``redis.RedisCluster``) for the plain
    methods, asyncio (``redis.asyncio.Redis``) for the ``a``-prefixed ones; give both (the sync
    one first, *async_client* for the other) where sync and async code share the filter, as they
    share a store. Clients made with ``decode_responses`` work too. A batch is one
    round trip and one atomic script: of concurrent adders of one new key, exactly one is told
    it was new. The key never expires by itself; delete it to start over, or rotate names (one
    filter per day, say) to forget old keys.

    .. versionadded:: 0.1.0
    """

    __slots__ = (
        "_async_script",
        "_bits_and_hashes",
        "_sync_script",
        "capacity",
        "error_rate",
        "name",
    )

    def __init__(
        self,
        client: Any,
        name: str,
        capacity: int,
        error_rate: float = 0.001,
        *,
        async_client: Any = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"name must be a non-empty str, not {name!r}")
        bits, hashes = bloom_size(capacity, error_rate)
        if bits > _MAX_BITS:
            raise ConfigurationError(
                f"{capacity} keys at error_rate {error_rate} need {bits} bits; a Redis string "
                f"holds at most {_MAX_BITS}: split the keys over several filters"
            )
        self.name = name
        self.capacity = capacity
        self.error_rate = float(error_rate)
        self._bits_and_hashes = (bits, hashes)
        sync_client, async_client = (None, client) if _is_async(client) else (client, async_client)
        if async_client is not None and not _is_async(async_client):
            raise ConfigurationError("async_client must be a redis.asyncio client")
        self._sync_script = None if sync_client is None else sync_client.register_script(_SCRIPT)
        self._async_script = None if async_client is None else async_client.register_script(_SCRIPT)

    @property
    def size_bytes(self) -> int:
        """The bit array's size in bytes, once full."""
        return math.ceil(self._bits_and_hashes[0] / 8)

    def _call(self, script: Any, keys: Sequence[str], write: bool) -> Any:
        if script is None:
            kind = "sync" if self._sync_script is None else "asyncio"
            raise ConfigurationError(
                f"this filter has no {kind} redis client: give one to RedisBloomFilter"
            )
        bits, hashes = self._bits_and_hashes
        return script(keys=[self.name], args=[bits, hashes, 1 if write else 0, *keys])

    def add_many(self, keys: Sequence[str]) -> list[bool]:
        """Add *keys* in one round trip; for each, whether it was certainly new before."""
        if not keys:
            return []
        return [bool(new) for new in self._call(self._sync_script, keys, True)]

    def might_contain_many(self, keys: Sequence[str]) -> list[bool]:
        """For each of *keys*: ``False`` if certainly never added, else ``True``."""
        if not keys:
            return []
        return [not new for new in self._call(self._sync_script, keys, False)]

    def add(self, key: str) -> bool:
        """Add *key*; return whether it was certainly new before."""
        return self.add_many([key])[0]

    def might_contain(self, key: str) -> bool:
        """``False``: *key* was certainly never added. ``True``: it maybe was."""
        return self.might_contain_many([key])[0]

    async def aadd_many(self, keys: Sequence[str]) -> list[bool]:
        """`add_many` on an asyncio client."""
        if not keys:
            return []
        return [bool(new) for new in await self._call(self._async_script, keys, True)]

    async def amight_contain_many(self, keys: Sequence[str]) -> list[bool]:
        """`might_contain_many` on an asyncio client."""
        if not keys:
            return []
        return [not new for new in await self._call(self._async_script, keys, False)]

    async def aadd(self, key: str) -> bool:
        """`add` on an asyncio client."""
        return (await self.aadd_many([key]))[0]

    async def amight_contain(self, key: str) -> bool:
        """`might_contain` on an asyncio client."""
        return (await self.amight_contain_many([key]))[0]

    def __repr__(self) -> str:
        return (
            f"RedisBloomFilter(name={self.name!r}, capacity={self.capacity}, "
            f"error_rate={self.error_rate})"
        )


def _is_async(client: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(client, "execute_command", None))
