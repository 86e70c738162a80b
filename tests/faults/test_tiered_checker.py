"""The tiered caches' checker on hand-made histories: a forgotten or expired result replayed past
the bound, two processes answering one key differently, and replays it must not report."""

from __future__ import annotations

from typing import Any

from tests.faults._history import History
from tests.faults._tiered import MAX_STALENESS, SLACK, check

PAST = MAX_STALENESS + SLACK + 0.1
"""Seconds past a result's end at which a replay of it is stale."""


def _history(*events: dict[str, Any]) -> History:
    history = History("hand-made", ttl=60.0, keys=["k"])
    for event in events:
        history.add({"key": "k", **event})
    return history


_FIRST = (
    {"ev": "run", "worker": "A", "value": "A1", "t": 0.0},
    {"ev": "stored", "worker": "A", "value": "A1", "t": 0.1},
    {"ev": "answer", "worker": "B", "value": "A1", "t": 0.5},
)


def _forgotten_at(t: float) -> dict[str, Any]:
    return {"ev": "forget", "worker": "campaign", "t": t, "done": t + 0.1}


def test_a_forgotten_result_replayed_past_the_bound_is_stale() -> None:
    history = _history(
        *_FIRST,
        _forgotten_at(1.0),
        {"ev": "answer", "worker": "B", "value": "A1", "t": 1.1 + PAST},
    )
    [anomaly] = check(history, ttl=60.0)
    assert anomaly.kind == "stale_replay"
    assert "forgotten" in anomaly.explanation


def test_a_stale_replay_after_another_process_answered_the_rerun_is_a_split() -> None:
    history = _history(
        *_FIRST,
        _forgotten_at(1.0),
        {"ev": "run", "worker": "campaign", "value": "R0", "t": 1.2},
        {"ev": "stored", "worker": "campaign", "value": "R0", "t": 1.3},
        {"ev": "answer", "worker": "B", "value": "A1", "t": 1.1 + PAST},
    )
    assert [anomaly.kind for anomaly in check(history, ttl=60.0)] == ["split_answer"]


def test_an_expired_result_replayed_past_the_bound_is_stale() -> None:
    history = _history(*_FIRST, {"ev": "answer", "worker": "C", "value": "A1", "t": 2.1 + PAST})
    [anomaly] = check(history, ttl=2.0)
    assert anomaly.kind == "stale_replay"
    assert "expired" in anomaly.explanation


def test_replays_within_the_bound_or_of_a_later_result_are_not_reported() -> None:
    history = _history(
        *_FIRST,
        _forgotten_at(1.0),
        {"ev": "answer", "worker": "B", "value": "A1", "t": 1.1 + MAX_STALENESS},
        {"ev": "run", "worker": "C", "value": "C1", "t": 1.2},
        {"ev": "stored", "worker": "C", "value": "C1", "t": 1.3},
        {"ev": "answer", "worker": "B", "value": "C1", "t": 1.1 + PAST},
        _forgotten_at(0.05),  # started before A1 was stored: it may not have removed A1
    )
    assert check(history, ttl=60.0) == []
