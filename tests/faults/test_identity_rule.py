"""The checker's identity rule (`tests.faults._identity.foreign_replays`): I2, a response
stored for one principal is never given to another."""

from __future__ import annotations

from typing import Any

from tests.faults._history import History
from tests.faults._identity import _who, foreign_replays


def _history(*events: dict[str, Any]) -> History:
    history = History("identity")
    for number, event in enumerate(events):
        history.add({"t": float(number), "worker": "client", **event})
    return history


def _run(op: str, principal: str | None) -> dict[str, Any]:
    return {"ev": "run", "op": op, "key": "k", "token": 1, "principal": principal}


def _ok(op: str, of: str, principal: str | None) -> dict[str, Any]:
    return {
        "ev": "ok",
        "op": op,
        "key": "k",
        "value": {"op": of, "token": 1},
        "principal": principal,
    }


def test_a_result_given_to_another_principal_is_flagged() -> None:
    history = _history(_run("A.1", "alice"), _ok("A.1", "A.1", "alice"), _ok("B.1", "A.1", "bob"))
    anomalies = foreign_replays(history)
    assert [anomaly.kind for anomaly in anomalies] == ["foreign_replay"]
    assert "bob" in anomalies[0].explanation


def test_own_results_and_anonymous_runs_are_not() -> None:
    """An anonymous record answers any caller (its response may have set the retry's cookie)."""
    history = _history(
        _run("A.1", "alice"),
        _ok("A.2", "A.1", "alice"),
        _run("N.1", None),
        _ok("N.2", "N.1", "alice"),
    )
    assert foreign_replays(history) == []


def test_the_app_verifies_tokens_by_subject() -> None:
    assert _who("Bearer alice-t1") == _who("Bearer alice-t7") == "alice"
    assert _who("Basic alice-t1") is None
    assert _who(None) is None
