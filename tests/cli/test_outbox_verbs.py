"""``oncely outbox dead | retry | dead-letter | resend`` on real PostgreSQL and SQLite: the
verbs an operator uses instead of editing the outbox table by hand."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from oncely.cli._app import cli
from oncely.outbox import Outbox
from tests.outbox._publisher import FilePublisher
from tests.outbox._relaying import add_events, close, drain, relay_for
from tests.outbox.conftest import Db, _postgres, _sqlite


@pytest.fixture(params=["postgres", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    yield from _postgres() if request.param == "postgres" else _sqlite(tmp_path)


def oncely(db: Db, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--store", db.url, "outbox", *args])


def ids_of(db: Db) -> dict[str, int]:
    """message id → row id."""
    return {row[1]: row[0] for row in db.query("SELECT id, message_id FROM {table}")}


def run(db: Db, publisher: FilePublisher, **options: Any) -> int:
    relay = relay_for(db, publisher, **options)
    try:
        return asyncio.run(drain(relay))
    finally:
        close(relay)


def sent(publisher: FilePublisher) -> list[object]:
    return [event["message_id"] for event in publisher.published()]


def test_a_dead_letter_is_listed_and_retried_after_its_keys_events(db: Db, tmp_path: Path) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", "k"), ("d", "k")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.fail_times[ids[0]] = 1
    assert run(db, publisher, max_attempts=1) == 0  # dead-lettered at once
    assert run(db, publisher) == 2  # its key goes on
    assert sent(publisher) == ids[1:]

    listed = oncely(db, "dead")
    assert listed.exit_code == 0, listed.output
    assert ids[0] in listed.output
    assert "Poisoned" in listed.output
    as_json = oncely(db, "dead", "--json")
    assert [event["message_id"] for event in json.loads(as_json.output)] == [ids[0]]

    old = ids_of(db)[ids[0]]
    retried = oncely(db, "retry", str(old))
    assert retried.exit_code == 0, retried.output
    assert f"retry: outbox event {old} is pending as event " in retried.output
    assert db.states()[ids[0]] == (False, False, 0, f"Poisoned: cannot publish {ids[0]}")
    assert ids_of(db)[ids[0]] > max(ids_of(db)[i] for i in ids[1:])  # after its key's events
    assert oncely(db, "dead").output.strip() == "no dead letters"
    assert run(db, publisher) == 1
    assert sent(publisher) == [*ids[1:], ids[0]]
    outbox.store.close()


def test_dead_lettering_a_failing_head_lets_its_scope_go_on(db: Db, tmp_path: Path) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", "k")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.fail_times[ids[0]] = 1_000
    assert run(db, publisher, backoff=60.0, max_backoff=60.0) == 0  # the head backs off

    row = ids_of(db)[ids[0]]
    result = oncely(db, "dead-letter", str(row))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"dead-letter: outbox event {row} is dead"
    published, dead, attempts, error = db.states()[ids[0]]
    assert (published, dead, attempts, error) == (False, True, 1, "dead-lettered by an operator")
    assert run(db, publisher) == 1
    assert sent(publisher) == [ids[1]]

    again = oncely(db, "dead-letter", str(row))
    assert again.exit_code == 4
    assert "it is dead-lettered already" in again.output
    done = oncely(db, "dead-letter", str(ids_of(db)[ids[1]]))
    assert done.exit_code == 4
    assert "it was published" in done.output
    outbox.store.close()


def test_retry_makes_a_backing_off_event_due_now(db: Db, tmp_path: Path) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", "k")])
    publisher = FilePublisher(tmp_path / "out")
    publisher.fail_times[ids[0]] = 1
    assert run(db, publisher, backoff=60.0, max_backoff=60.0) == 0
    row = ids_of(db)[ids[0]]
    result = oncely(db, "retry", str(row), "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert (answer["id"], answer["state"], answer["attempts"]) == (row, "pending", 1)
    assert run(db, publisher, backoff=60.0, max_backoff=60.0) == 2
    assert sent(publisher) == ids
    outbox.store.close()


def test_resend_publishes_a_published_event_again_with_its_message_id(
    db: Db, tmp_path: Path
) -> None:
    outbox = Outbox(db.store())
    ids = add_events(db, outbox, [("d", "k"), ("d", None)])
    publisher = FilePublisher(tmp_path / "out")
    assert run(db, publisher) == 2
    for message_id in ids:
        result = oncely(db, "resend", str(ids_of(db)[message_id]))
        assert result.exit_code == 0, result.output
    assert all(state == (False, False, 0, None) for state in db.states().values())
    pending = oncely(db, "resend", str(ids_of(db)[ids[0]]))
    assert pending.exit_code == 4
    assert "it is pending" in pending.output
    assert run(db, publisher) == 2
    assert sent(publisher) == [*ids, *ids]
    outbox.store.close()


def test_an_unknown_event_exits_1_and_a_bad_id_2(db: Db) -> None:
    missing = oncely(db, "retry", "999999")
    assert missing.exit_code == 1
    assert "no outbox event 999999" in missing.output
    bad = oncely(db, "resend", "seven")
    assert bad.exit_code == 2
    assert "not a valid integer" in bad.output
