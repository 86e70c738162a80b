"""Read by mypy (scripts/test), never run: the public API keeps precise types.

Under --strict, warn_unused_ignores turns each expected-error ignore into a regression test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Coroutine
from typing import Any

from typing_extensions import assert_type

import oncely


@dataclasses.dataclass
class Receipt:
    order_id: str


store = oncely.open_store("memory://")


@oncely.idempotent(store=store, key="order_id")
def charge(order_id: str, amount_cents: int) -> Receipt:
    return Receipt(order_id)


@oncely.idempotent(store=store, key="order_id", final_errors=(KeyError,))
async def acharge(order_id: str, amount_cents: int) -> Receipt:
    return Receipt(order_id)


async def uses() -> None:
    assert_type(charge("o-1", 500), Receipt)
    assert_type(await acharge("o-1", 500), Receipt)
    assert_type(charge.with_key("k")("o-1", 5), Receipt)
    assert_type(charge.policy, oncely.Policy)
    charge(order_id="o-1", amount_cents="500")  # type: ignore[arg-type]
    charge("o-1")  # type: ignore[call-arg]
    oncely.idempotent(store=store, key="k", on_conflict="sometimes")  # type: ignore[arg-type]

    answer = store.claim("k", "fp", lease=oncely.Policy().lease, ttl=oncely.Policy().ttl)
    if isinstance(answer, oncely.Acquired):
        assert_type(answer.token, int)
    with oncely.Guard(store, "k") as guard:
        assert_type(guard.token, int)


def batch_stores() -> None:
    """Every built-in store satisfies the optional batch protocol, structurally."""
    from oncely.stores.memory import MemoryStore
    from oncely.stores.postgres import PostgresStore
    from oncely.stores.redis import RedisClusterStore, RedisStore
    from oncely.stores.sqlite import SQLiteStore
    from oncely.stores.tiered import TieredStore

    stores: list[oncely.BatchStore] = [MemoryStore(), SQLiteStore(":memory:")]
    stores.append(TieredStore(MemoryStore()))
    stores.append(RedisStore.from_url("redis://localhost"))
    stores.append(RedisClusterStore.from_url("redis+cluster://localhost:7000"))
    stores.append(PostgresStore.from_url("postgresql://localhost/db"))
    policy = oncely.Policy()
    for batching in stores:
        answers = batching.claim_many([("k", "fp")], lease=policy.lease, ttl=policy.ttl)
        assert_type(answers, list[oncely.ClaimResult | oncely.StoreError])
    MemoryStore().claim_many(["k"], lease=policy.lease, ttl=policy.ttl)  # type: ignore[list-item]


def inbox_decorator() -> None:
    """`Inbox.idempotent` keeps the decorated function's signature, sync and async."""
    import sqlite3

    inbox = oncely.Inbox(oncely.open_store("sqlite:///typing.db"))

    @inbox.idempotent(key="order_id")
    def place(conn: sqlite3.Connection, order_id: str) -> Receipt:
        return Receipt(order_id)

    @inbox.idempotent(key=lambda conn, order_id: order_id, connection="conn")
    async def aplace(conn: object, order_id: str) -> Receipt:
        return Receipt(order_id)

    connection = sqlite3.connect(":memory:")
    assert_type(place(connection, "o-1"), Receipt)
    pending = aplace(connection, "o-1")
    _ = assert_type(pending, Coroutine[Any, Any, Receipt])
    pending.close()
    place(connection, 1)  # type: ignore[arg-type]
