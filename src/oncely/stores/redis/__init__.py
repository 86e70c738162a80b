"""The Redis stores: `RedisStore` (``redis://``, ``rediss://``) and `RedisClusterStore`
(``redis+cluster://``).

Importing this package does not import redis-py; constructing a store does (the ``redis`` extra).
"""

from oncely.stores.redis.store import RedisClusterStore, RedisStore

__all__ = ["RedisClusterStore", "RedisStore"]
