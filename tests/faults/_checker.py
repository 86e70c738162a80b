"""Judge a history: every way the promise "takes effect once" can be broken, with the evidence.

Pure: it reads the events of a `History` and the rows of the fenced effects table, nothing else.
The promise, as the checker reads it:

- ``double_effect``: two operations' writes were accepted for one key (fencing failed).
- ``rerun``: the handler ran again for a key after an earlier run took effect, although that
  run's worker was neither killed nor stopped and the outcome had not expired.
- ``overlap``: two runs of one key were in flight at once while the first holder was alive
  and not stopped (its lease was live, so nobody else may run).
- ``token_order``: a key's runs got fencing tokens that did not grow.
- ``lost_result``: a client was acknowledged a result that is not the key's outcome (another
  client got a different one, or no write of the acknowledged run stands).
- ``failed_but_applied``: a client was told its operation failed, yet that operation's write
  was accepted.
- ``phantom_in_progress``: a client was told the key is in progress while no run held it
  (nor any killed or stopped worker, nor another client's claim whose outcome it could not
  learn, for one lease after it: that claim may have been applied with its reply lost):
  a lease that nobody runs under, until it expires.
- ``acked_not_run``: a message was acknowledged but no write for it stands.
- ``truncated_run``: the handler ran on a request body shorter than its client announced
  (`tests.faults._edges`).
- ``unfinished``: no client ever got a result for the key and no consumer acked it (a client
  told it ran and its result cannot be had is finished: a response cut short is never
  replayed, by design).
- ``stale_replay``, ``split_answer``: a tiered cache replayed a forgotten or expired result past
  its bound (`tests.faults._tiered`).
- ``foreign_replay``: a client was given the result of a run made for another principal
  (`tests.faults._identity.foreign_replays`).
- ``hidden_mismatch``: a key reused with other arguments was not refused to its caller, or a
  caller got the result of a run made from other arguments (`tests.faults._celery_reuse`).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.faults._history import FINAL_ERRORS, UNKNOWN_ERRORS, Event, History

KINDS = (
    "double_effect",
    "rerun",
    "overlap",
    "token_order",
    "lost_result",
    "failed_but_applied",
    "phantom_in_progress",
    "acked_not_run",
    "unfinished",
    "stale_replay",
    "split_answer",
    "foreign_replay",
    "truncated_run",
    "hidden_mismatch",
)


_SLACK = 0.5
"""Seconds between a claim and its ``run`` event (or an end and its release) that a loaded
machine may take: an in-progress answer that close to a run is not judged phantom."""


@dataclass(frozen=True)
class Anomaly:
    kind: str
    key: str
    explanation: str

    def __str__(self) -> str:
        return f"{self.kind} on {self.key}: {self.explanation}"


@dataclass
class _Run:
    op: str
    key: str
    worker: str
    token: int
    lease: str
    """The store key its lease is on: tokens compare only within one (an HTTP client's
    new request gets a new idempotency key for the same order)."""
    start: float
    end: float = math.inf
    effect_at: float | None = None


def check(history: History, effects: Iterable[Mapping[str, Any]]) -> list[Anomaly]:
    """Return every anomaly of *history* given the effects table's rows for its keys.

    Each effect row has ``key``, ``op``, ``token`` and ``accepted``.
    """
    rows = list(effects)
    anomalies: list[Anomaly] = []
    excused = {event["op"] for event in history.of("fault") if event.get("excuses")}
    accepted: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["accepted"]:
            accepted[row["key"]].append(row)
    applied_ops = {(row["key"], row["op"]) for rows_ in accepted.values() for row in rows_}

    for key, key_rows in accepted.items():
        ops = sorted({row["op"] for row in key_rows})
        if len(ops) > 1:
            tokens = ", ".join(f"{row['op']} with token {row['token']}" for row in key_rows)
            anomalies.append(
                Anomaly("double_effect", key, f"{len(ops)} operations' writes stand: {tokens}")
            )

    runs = _runs(history.events)
    by_key: dict[str, list[_Run]] = defaultdict(list)
    for run in runs:
        by_key[run.key].append(run)
    for key, key_runs in by_key.items():
        key_runs.sort(key=lambda run: run.start)
        anomalies += _judge_runs(key, key_runs, excused, history.ttl)

    oks: dict[str, list[Event]] = defaultdict(list)
    for event in history.of("ok"):
        oks[event["key"]].append(event)
    for key, events in oks.items():
        values = {_outcome(event) for event in events}
        if len(values) > 1:
            seen = "; ".join(f"{event['op']} got {_outcome(event)}" for event in events)
            anomalies.append(Anomaly("lost_result", key, f"clients got different results: {seen}"))
        for op, token in sorted(values):
            if (key, op) not in applied_ops:
                anomalies.append(
                    Anomaly(
                        "lost_result",
                        key,
                        f"a client was acknowledged {op}'s result (token {token}), "
                        f"but no write of {op} stands",
                    )
                )

    for event in history.of("fail"):
        if event["error"] in UNKNOWN_ERRORS:
            continue
        if (event["key"], event["op"]) in applied_ops:
            anomalies.append(
                Anomaly(
                    "failed_but_applied",
                    event["key"],
                    f"{event['op']} was told {event['error']}, but its write stands",
                )
            )

    faulted_keys = {event["key"] for event in history.of("fault") if event.get("excuses")}
    invoked = {(event["key"], event["op"]): event["t"] for event in history.of("invoke")}
    unknown_claims = [  # (key, op, from, until): may hold the key, unknown to its client
        (
            event["key"],
            event["op"],
            invoked.get((event["key"], event["op"]), event["t"]),
            event["t"] + history.lease,
        )
        for event in history.of("fail")
        if event["error"] in UNKNOWN_ERRORS
    ]
    for event in history.of("fail"):
        key = event["key"]
        if event["error"] != "InProgressError" or key in faulted_keys:
            continue
        at = event["t"]
        holders: list[Any] = [
            run
            for run in by_key.get(key, [])
            if run.start <= at + _SLACK and run.end >= at - _SLACK and run.op != event["op"]
        ]
        holders += [
            op
            for claimed_key, op, start, until in unknown_claims
            if claimed_key == key and op != event["op"] and start <= at and at <= until + _SLACK
        ]
        if not holders:
            anomalies.append(
                Anomaly(
                    "phantom_in_progress",
                    key,
                    f"{event['op']} was told the key is in progress, but no run held it",
                )
            )

    for event in history.of("ack"):
        if event["key"] not in accepted:
            anomalies.append(
                Anomaly("acked_not_run", event["key"], f"acked by {event['worker']}, never run")
            )

    invoked = {event["key"] for event in history.of("invoke")} | set(history.keys)
    ended = {event["key"] for event in history.of("fail") if event["error"] in FINAL_ERRORS}
    ended |= {event["key"] for event in history.of("ack")}  # a message's story ends at its ack
    for key in sorted(invoked - set(oks) - ended):
        anomalies.append(Anomaly("unfinished", key, "no client ever got a result"))
    return anomalies


def _outcome(event: Event) -> tuple[str, int]:
    value = event["value"]
    return (str(value["op"]), int(value["token"]))


def _runs(events: Sequence[Event]) -> list[_Run]:
    runs: dict[str, _Run] = {}
    for event in events:
        kind = event["ev"]
        if kind == "run":
            runs[event["op"]] = _Run(
                event["op"],
                event["key"],
                event["worker"],
                int(event["token"]),
                event.get("lease", event["key"]),
                event["t"],
            )
        elif kind == "effect" and event["accepted"] and event["op"] in runs:
            runs[event["op"]].effect_at = event["t"]
        elif kind == "end" and event["op"] in runs:
            runs[event["op"]].end = event["t"]
    return list(runs.values())


def _judge_runs(key: str, runs: list[_Run], excused: set[str], ttl: float) -> list[Anomaly]:
    anomalies: list[Anomaly] = []
    by_lease: dict[str, list[_Run]] = defaultdict(list)
    for run in runs:
        by_lease[run.lease].append(run)
    pairs = [pair for same in by_lease.values() for pair in itertools.pairwise(same)]
    for earlier, later in pairs:
        if later.token <= earlier.token:
            anomalies.append(
                Anomaly(
                    "token_order",
                    key,
                    f"{later.op} ran with token {later.token} after {earlier.op} "
                    f"ran with token {earlier.token}",
                )
            )
    for index, later in enumerate(runs):
        for earlier in runs[:index]:
            if earlier.op in excused:
                continue
            if earlier.effect_at is not None and earlier.effect_at <= later.start:
                if later.start < earlier.end + ttl:
                    anomalies.append(
                        Anomaly(
                            "rerun",
                            key,
                            f"{later.op} ({later.worker}) ran again after {earlier.op} "
                            f"({earlier.worker}) took effect, within the ttl",
                        )
                    )
            elif later.start < earlier.end:
                anomalies.append(
                    Anomaly(
                        "overlap",
                        key,
                        f"{later.op} ({later.worker}, token {later.token}) ran while "
                        f"{earlier.op} ({earlier.worker}, token {earlier.token}) was still "
                        f"running, alive and not stopped",
                    )
                )
    return anomalies


def summary(anomalies: Sequence[Anomaly]) -> dict[str, int]:
    """Anomalies counted by kind (every kind present, zeros included)."""
    counts = dict.fromkeys(KINDS, 0)
    for anomaly in anomalies:
        counts[anomaly.kind] += 1
    return counts
