"""The reused-key check (`tests.faults._celery_reuse.hidden_mismatches`) on hand-made histories."""

from __future__ import annotations

from typing import Any

from tests.faults._celery_reuse import FIRST, OTHER, hidden_mismatches
from tests.faults._history import History

FIRST_RUN = {"op": "W-1", "token": 1, "cents": FIRST}


def history(*answers: tuple[str, int, dict[str, Any]]) -> History:
    """The client's calls on key ``k``: (op, cents sent, its ``ok``/``fail`` fields)."""
    made = History("h")
    for op, cents, answer in answers:
        made.add({"ev": "invoke", "op": op, "key": "k", "cents": cents, "reuse": cents != FIRST})
        made.add({"op": op, "key": "k", "cents": cents, **answer})
    return made


def kinds(made: History) -> list[str]:
    return [anomaly.kind for anomaly in hidden_mismatches(made)]


def test_a_reuse_refused_with_the_mismatch_is_no_anomaly() -> None:
    made = history(
        ("A", FIRST, {"ev": "ok", "value": FIRST_RUN}),
        ("B", OTHER, {"ev": "fail", "error": "FingerprintMismatchError"}),
        ("A-again", FIRST, {"ev": "ok", "value": FIRST_RUN}),
    )
    assert kinds(made) == []


def test_a_reuse_answered_with_the_first_result_is_hidden() -> None:
    made = history(
        ("A", FIRST, {"ev": "ok", "value": FIRST_RUN}),
        ("B", OTHER, {"ev": "ok", "value": FIRST_RUN}),
    )
    assert kinds(made) == ["hidden_mismatch", "hidden_mismatch"]  # not refused; not its result


def test_a_reuse_never_told_why_is_hidden() -> None:
    made = history(
        ("A", FIRST, {"ev": "ok", "value": FIRST_RUN}),
        ("B", OTHER, {"ev": "fail", "error": "TimeoutError"}),
    )
    assert kinds(made) == ["hidden_mismatch"]


def test_a_first_result_overwritten_by_the_reuse_is_hidden() -> None:
    made = history(
        ("A", FIRST, {"ev": "ok", "value": FIRST_RUN}),
        ("B", OTHER, {"ev": "fail", "error": "FingerprintMismatchError"}),
        ("A-again", FIRST, {"ev": "ok", "value": {**FIRST_RUN, "op": "W-2", "cents": OTHER}}),
    )
    assert kinds(made) == ["hidden_mismatch"]
