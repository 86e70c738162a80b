"""The checker on hand-made histories: each anomaly it must report, and look-alikes it must not."""

from __future__ import annotations

from typing import Any

from tests.faults._checker import check, summary
from tests.faults._history import History


def _history(*events: dict[str, Any], ttl: float = 60.0, keys: tuple[str, ...] = ()) -> History:
    history = History("hand-made", ttl=ttl, keys=list(keys))
    for t, event in enumerate(events):
        history.add({"worker": event["op"].partition("-")[0], "key": "k", "t": float(t), **event})
    return history


def _row(op: str, token: int, accepted: bool = True, key: str = "k") -> dict[str, Any]:
    return {"key": key, "op": op, "token": token, "accepted": accepted}


def _kinds(history: History, rows: list[dict[str, Any]]) -> list[str]:
    return sorted(anomaly.kind for anomaly in check(history, rows))


def _ran(op: str, token: int) -> list[dict[str, Any]]:
    """A whole run that took effect and reported its result."""
    return [
        {"ev": "invoke", "op": op},
        {"ev": "run", "op": op, "token": token},
        {"ev": "effect", "op": op, "token": token, "accepted": True},
        {"ev": "end", "op": op},
        {"ev": "ok", "op": op, "value": {"op": op, "token": token}},
    ]


def _replayed(op: str, of: str, token: int) -> list[dict[str, Any]]:
    return [{"ev": "invoke", "op": op}, {"ev": "ok", "op": op, "value": {"op": of, "token": token}}]


def test_a_clean_history_has_no_anomaly() -> None:
    history = _history(*_ran("A-1", 1), *_replayed("B-1", "A-1", 1))
    assert check(history, [_row("A-1", 1)]) == []


def test_two_standing_writes_are_a_double_effect() -> None:
    history = _history(*_ran("A-1", 1), *_replayed("B-1", "A-1", 1))
    rows = [_row("A-1", 1), _row("B-1", 1)]
    assert "double_effect" in _kinds(history, rows)


def test_a_zombie_write_that_the_fence_rejected_is_no_anomaly() -> None:
    """A stopped past its lease (excused), B took over; A's late write was rejected and A was
    told LeaseLostError: all as promised."""
    history = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "fault", "op": "A-1", "kind": "stop@mid", "excuses": True},
        *_ran("B-1", 2),
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": False},
        {"ev": "end", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "LeaseLostError"},
    )
    assert check(history, [_row("B-1", 2), _row("A-1", 1, accepted=False)]) == []


def test_tokens_that_do_not_grow_are_reported() -> None:
    history = _history(
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "fault", "op": "A-1", "kind": "stop@mid", "excuses": True},
        *_ran("B-1", 1),
    )
    assert _kinds(history, [_row("B-1", 1)]) == ["token_order"]


def test_a_second_run_after_the_effect_is_a_rerun() -> None:
    """The first run took effect and its worker lived on; running again breaks the promise
    even though the downstream adopted the first write (no double effect is visible there)."""
    history = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": True},
        {"ev": "end", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "ReadTimeout"},
        {"ev": "invoke", "op": "B-1"},
        {"ev": "run", "op": "B-1", "token": 2},
        {"ev": "adopt", "op": "B-1", "of": "A-1"},
        {"ev": "end", "op": "B-1"},
        {"ev": "ok", "op": "B-1", "value": {"op": "A-1", "token": 1}},
    )
    assert _kinds(history, [_row("A-1", 1)]) == ["rerun"]


def test_a_rerun_after_a_kill_or_after_the_ttl_is_not_reported() -> None:
    killed = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": True},
        {"ev": "fault", "op": "A-1", "kind": "kill@effect", "excuses": True},
        {"ev": "invoke", "op": "B-1"},
        {"ev": "run", "op": "B-1", "token": 2},
        {"ev": "adopt", "op": "B-1", "of": "A-1"},
        {"ev": "end", "op": "B-1"},
        {"ev": "ok", "op": "B-1", "value": {"op": "A-1", "token": 1}},
    )
    assert check(killed, [_row("A-1", 1)]) == []
    expired = _history(*_ran("A-1", 1), *_ran("B-1", 2), ttl=0.5)
    kinds = _kinds(expired, [_row("A-1", 1), _row("B-1", 2)])
    assert "rerun" not in kinds
    assert "overlap" not in kinds


def test_a_live_holder_overlapped_by_another_run_is_reported() -> None:
    history = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "run", "op": "B-1", "token": 2},
        {"ev": "effect", "op": "B-1", "token": 2, "accepted": True},
        {"ev": "end", "op": "B-1"},
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": False},
        {"ev": "end", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "Fenced"},
        {"ev": "ok", "op": "B-1", "value": {"op": "B-1", "token": 2}},
    )
    assert _kinds(history, [_row("B-1", 2), _row("A-1", 1, accepted=False)]) == ["overlap"]


def test_an_acknowledged_result_that_is_not_the_outcome_is_lost() -> None:
    history = _history(*_ran("A-1", 1), *_replayed("B-1", "C-1", 2))
    assert "lost_result" in _kinds(history, [_row("A-1", 1)])
    unwritten = _history({"ev": "invoke", "op": "A-1"}, *_replayed("A-1", "A-1", 1))
    assert _kinds(unwritten, []) == ["lost_result"]


def test_failed_is_reported_only_when_the_operation_took_effect() -> None:
    told = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": True},
        {"ev": "end", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "LeaseLostError"},
        *_replayed("B-1", "A-1", 1),
    )
    assert _kinds(told, [_row("A-1", 1)]) == ["failed_but_applied"]
    unknown = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": True},
        {"ev": "end", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "StoreUnavailableError"},
        *_replayed("B-1", "A-1", 1),
    )
    assert check(unknown, [_row("A-1", 1)]) == []
    not_run = _history(
        {"ev": "invoke", "op": "B-1"},
        {"ev": "run", "op": "B-1", "token": 1},
        {"ev": "invoke", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "InProgressError"},
        {"ev": "effect", "op": "B-1", "token": 1, "accepted": True},
        {"ev": "end", "op": "B-1"},
        {"ev": "ok", "op": "B-1", "value": {"op": "B-1", "token": 1}},
    )
    assert check(not_run, [_row("B-1", 1)]) == []


def test_an_ack_without_a_standing_write_is_reported() -> None:
    history = _history({"ev": "ack", "op": "A-1"}, keys=())
    kinds = _kinds(history, [_row("A-1", 1, accepted=False)])
    assert kinds == ["acked_not_run"]


def test_a_key_nobody_got_a_result_for_is_unfinished() -> None:
    history = _history(keys=("k",))
    assert _kinds(history, []) == ["unfinished"]
    assert summary(check(history, []))["unfinished"] == 1


def test_in_progress_with_no_run_holding_the_key_is_a_phantom() -> None:
    phantom = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "fail", "op": "A-1", "error": "InProgressError"},
        {"ev": "invoke", "op": "B-1"},
        {"ev": "fail", "op": "B-1", "error": "InProgressError"},
        *_ran("C-1", 1),
    )
    phantom.events[1]["t"] = phantom.events[3]["t"] = -5.0  # long before C-1 ran
    assert _kinds(phantom, [_row("C-1", 1)]) == ["phantom_in_progress"] * 2
    held = _history(
        {"ev": "invoke", "op": "A-1"},
        {"ev": "run", "op": "A-1", "token": 1},
        {"ev": "invoke", "op": "B-1"},
        {"ev": "fail", "op": "B-1", "error": "InProgressError"},
        {"ev": "effect", "op": "A-1", "token": 1, "accepted": True},
        {"ev": "end", "op": "A-1"},
        {"ev": "ok", "op": "A-1", "value": {"op": "A-1", "token": 1}},
    )
    assert check(held, [_row("A-1", 1)]) == []


def test_in_progress_within_a_lease_of_a_claim_whose_reply_was_lost_is_no_phantom() -> None:
    """A's claim failed with the store unreachable (a restart): it may have been applied, so
    the key may be held for one lease; B told in progress then is as promised, later not."""

    def story(b_at: float) -> History:
        history = _history(
            {"ev": "invoke", "op": "A-1"},
            {"ev": "fail", "op": "A-1", "error": "StoreUnavailableError"},
            {"ev": "invoke", "op": "B-1"},
            {"ev": "fail", "op": "B-1", "error": "InProgressError"},
            *_ran("C-1", 1),
        )
        history.lease = 1.5
        history.events[2]["t"] = history.events[3]["t"] = b_at
        return history

    assert check(story(2.0), [_row("C-1", 1)]) == []  # within 1.5 s (+ slack) of A's failure
    assert _kinds(story(4.0), [_row("C-1", 1)]) == ["phantom_in_progress"]
