"""The relay histories' check (`tests.faults._relay.check`) on hand-made tables and effects."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from tests.faults._relay import check

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
MISSING = "nowhere/x"


def row(seq: int, published: float | None = None, dead: float | None = None, **extra: Any) -> Any:
    """Event *seq* of scope (q, k), published or dead-lettered *published*/*dead* s after T0."""
    return {
        "id": seq,
        "message_id": f"m{seq}",
        "destination": "q",
        "key": "k",
        "seq": seq,
        "published_at": None if published is None else T0 + timedelta(seconds=published),
        "dead_at": None if dead is None else T0 + timedelta(seconds=dead),
        "headers": {},
        **extra,
    }


def kinds(rows: list[Any], effects: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(anomaly.kind, anomaly.key) for anomaly in check(rows, effects, MISSING)]


def test_a_clean_history_has_no_anomaly() -> None:
    rows = [row(1, 1.0), row(2, 1.0), row(3, dead=2.0), row(4, 3.0), row(5, destination=MISSING)]
    assert kinds(rows, [("q", "m1"), ("q", "m2"), ("q", "m4")]) == []


def test_each_anomaly_is_found() -> None:
    rows = [row(1, 1.0), row(2, 1.0), row(3, 3.0), row(4, 2.0), row(5)]
    effects = [("q", "m2"), ("q", "m1"), ("q", "m1"), ("q", "m4"), ("q", "m3")]
    assert sorted(kinds(rows, effects)) == [
        ("duplicate_effect", "m1"),
        ("lost_event", "m5"),
        ("marked_out_of_order", "m4"),  # published at 2 s, seq 3 only at 3 s
        ("out_of_order", "('q', 'k')"),
    ]


def test_a_scope_with_a_refused_event_is_not_judged_on_consumption_order() -> None:
    rows = [row(1, 2.0, headers={"fault": "refuse-once"}), row(2, 2.0)]
    assert kinds(rows, [("q", "m2"), ("q", "m1")]) == []


def test_a_key_whose_counter_was_purged_is_judged_in_id_order() -> None:
    # Every event of k was published, so a purge deleted k's counter, and the next event of k
    # was numbered 1 again: a later id with a lower seq. Commit order is id order, and this
    # history is in it (the shape a campaign run once reported as out of order).
    old = [row(seq, 1.0 + seq / 100, id=seq) for seq in (1, 3, 5, 7, 9, 11, 13)]
    rows = [*old, row(1, 2.0, id=14, message_id="m1-again")]
    effects = [("q", f"m{seq}") for seq in (1, 3, 5, 7, 9, 11, 13)] + [("q", "m1-again")]
    assert kinds(rows, effects) == []


def test_after_a_purged_counter_order_is_still_judged() -> None:
    rows = [row(1, 1.0, id=1), row(2, 3.0, id=2), row(1, 2.0, id=3, message_id="m1-again")]
    effects = [("q", "m1"), ("q", "m1-again"), ("q", "m2")]
    assert sorted(kinds(rows, effects)) == [
        ("marked_out_of_order", "m1-again"),  # published at 2 s, the event before it at 3 s
        ("out_of_order", "('q', 'k')"),
    ]
