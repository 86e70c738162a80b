"""A failure stays with its event and its (destination, ordering key): a publish that never
returns, a destination that refuses everything, a publisher that confirms past a refusal.

On real PostgreSQL and SQLite, through `FilePublisher` (the relay is under test here).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from oncely.outbox import Outbox
from oncely.outbox._store import Settlement, backend_for
from tests.outbox._publisher import FilePublisher
from tests.outbox._relaying import add_events, close, drain, relay_for, until
from tests.outbox.conftest import Db


def test_an_event_whose_publish_never_returns_is_dead_lettered_and_stalls_nothing(
    db: Db, tmp_path: Path
) -> None:
    """The call holding event b never returns: the timeout counts against b alone, b is
    dead-lettered after its attempts, every other event (of b's key too, after it) goes out."""
    outbox = Outbox(db.store())
    ids = add_events(
        db, outbox, [("d", "a"), ("d", "b"), ("d", None), ("d", "a"), ("e", "c"), ("d", "b")]
    )
    publisher = FilePublisher(tmp_path / "out")
    publisher.hang.add(ids[1])
    relay = relay_for(db, publisher, publish_timeout=0.1, max_attempts=2)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        await until(lambda: len(publisher.published()) == 5, timeout=60)
        stop.set()
        await task

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    order = [event["message_id"] for event in publisher.published()]
    assert sorted(order) == sorted(ids[:1] + ids[2:])
    assert order.index(ids[0]) < order.index(ids[3])
    published, dead, attempts, error = db.states()[ids[1]]
    assert (published, dead, attempts) == (False, True, 2)
    assert "TimeoutError" in (error or "")
    assert all(db.states()[i][:3] == (True, False, 0) for i in ids if i != ids[1])
    outbox.store.close()


def test_a_broker_that_never_answers_costs_one_attempt_per_cycle(db: Db, tmp_path: Path) -> None:
    """Every call hangs: one cycle counts its timeout against the oldest event only (what it
    was for, as far as anyone can tell), and leaves the rest as they were."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "a"), ("d", "b"), ("d", None), ("d", "a")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.hang.update(ids)
    relay = relay_for(db, publisher, publish_timeout=0.05, backoff=60.0, max_backoff=60.0)

    async def scenario() -> None:
        try:
            await relay.run_once()
        except TimeoutError:
            pass
        else:
            raise AssertionError("a cycle that published nothing must raise")

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    states = db.states()
    assert states[ids[0]][:3] == (False, False, 1)
    assert all(states[i][:3] == (False, False, 0) for i in ids[1:])
    assert publisher.published() == []
    outbox.store.close()


def test_a_refusing_destination_holds_back_only_its_own_events_of_a_key(
    db: Db, tmp_path: Path
) -> None:
    """Order is kept per (destination, key): events of key k to a destination that refuses
    them wait, events of k to a healthy destination go out, in their order."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("missing", "k"), ("missing", "k")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.poison.add("missing")
    relay = relay_for(db, publisher, backoff=60.0, max_backoff=60.0)
    try:
        assert asyncio.run(drain(relay)) == 0  # the head failed, and backs off for a minute
        later = add_events(db, outbox, [("ok", "k"), ("missing", "k"), ("ok", "k")])
        assert asyncio.run(drain(relay)) == 2
    finally:
        close(relay)
    assert [event["message_id"] for event in publisher.published()] == [later[0], later[2]]
    states = db.states()
    assert states[ids[0]][:3] == (False, False, 1)
    assert states[ids[1]][:3] == states[later[1]][:3] == (False, False, 0)  # behind their head
    outbox.store.close()


def test_an_event_confirmed_after_an_earlier_refusal_of_its_key_is_not_marked_published(
    db: Db, tmp_path: Path
) -> None:
    """A publisher that went on past a refused event (pipelined confirms): the later event of
    that (destination, key) stays pending, and is published again after the refused one."""
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", "k"), ("d", "k"), ("e", "k")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.keep_going = True
    publisher.fail_times[ids[1]] = 1
    relay = relay_for(db, publisher, backoff=0.001, max_backoff=0.001)

    async def scenario() -> None:
        assert await relay.run_once() == 2  # ids[0] and ids[3], another destination
        states = db.states()
        assert states[ids[1]][:3] == (False, False, 1)
        assert states[ids[2]][:3] == (False, False, 0)  # confirmed, yet not published
        await asyncio.sleep(0.01)  # past ids[1]'s backoff
        assert await relay.run_once() == 2

    try:
        asyncio.run(scenario())
    finally:
        close(relay)
    assert all(state[0] for state in db.states().values())
    sent = [event["message_id"] for event in publisher.published()]
    assert sent == [ids[0], ids[2], ids[3], ids[1], ids[2]]  # ids[2] again, after ids[1]
    outbox.store.close()


def test_migrate_adds_the_scope_index_to_an_existing_outbox(db: Db) -> None:
    """An outbox made before order was kept per destination gets its index from migrate()."""
    db.execute(
        "DROP INDEX "
        + (f'"{db.schema}".' if db.kind == "postgres" else "")
        + "oncely_outbox_pending_scope"
    )
    store = db.store()
    try:
        store.migrate()
    finally:
        store.close()
    query = (
        f"SELECT indexname FROM pg_indexes WHERE schemaname = '{db.schema}'"
        if db.kind == "postgres"
        else "SELECT name FROM sqlite_master WHERE type = 'index'"
    )
    assert ("oncely_outbox_pending_scope",) in db.query(query)


@pytest.mark.postgres
def test_a_claim_beside_another_takes_other_scopes_and_lets_go_of_the_held_ones(pg: Db) -> None:
    """The first claim holds key k's first two events. A second claim's oldest due events are
    k's third (not ready: k's head is held) and m's, added since: it takes m's event alone, and
    lets go of k's third before it publishes, so a third claim, once the first has committed,
    takes it (locked until the second one ended, it would be skipped and k would wait)."""
    store = pg.store()
    outbox = Outbox(store)
    ids = add_events(pg, outbox, [("d", "k"), ("d", "k"), ("d", "k")])
    backend = backend_for(store, "the test")
    hold = timedelta(seconds=60)

    async def scenario() -> None:
        claiming = backend.claim(2, hold)
        first = await claiming.__aenter__()
        assert [event.message_id for event in first.events] == ids[:2]
        ids.extend(add_events(pg, outbox, [("d", "m")]))
        async with backend.claim(2, hold) as second:
            assert [event.message_id for event in second.events] == [ids[3]]
            await first.settle(Settlement(published=[event.id for event in first.events]))
            await claiming.__aexit__(None, None, None)  # commits
            async with backend.claim(2, hold) as third:
                assert [event.message_id for event in third.events] == [ids[2]]

    try:
        asyncio.run(scenario())
    finally:
        store.close()
