"""What the dashboard shows, computed from a store's live records: pure, no I/O.

One pass over the records (`Snapshot.add`) counts them by status and scope, lists the leases
that lapsed without a settle, and buckets first claims, completions and retried records by
minute over the last hours. The records carry everything this needs (their times are the store's
clock), so every process's work is seen, whichever process did it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from oncely._core.records import Record, Status
from oncely.observe.activity import KINDS

__all__ = ["MINUTE_MS", "Snapshot", "activity_gauges"]

MINUTE_MS = 60_000


def _scope(key: str) -> str:
    scope, separator, _ = key.partition("|")
    return scope if separator else "(unscoped)"


@dataclass(slots=True)
class Snapshot:
    """The dashboard's view of a store at *now_ms* (the store's clock), *minutes* of history.

    Args:
        now_ms: When the snapshot is taken.
        minutes: How many minutes the activity series covers.
        max_records: Records read at most; past it the snapshot says it is partial.
        max_listed: Stuck leases listed at most (all are counted).
    """

    now_ms: int
    minutes: int = 180
    max_records: int = 100_000
    max_listed: int = 50
    records: int = 0
    partial: bool = False
    by_status: Counter[str] = field(default_factory=Counter)
    by_scope: dict[str, Counter[str]] = field(default_factory=dict)
    stuck: list[dict[str, Any]] = field(default_factory=list)
    stuck_count: int = 0
    started: list[int] = field(init=False)
    finished: list[int] = field(init=False)
    retried: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.started = [0] * self.minutes
        self.finished = [0] * self.minutes
        self.retried = [0] * self.minutes

    @property
    def first_minute_ms(self) -> int:
        """The start of the series' first minute."""
        return (self.now_ms // MINUTE_MS - self.minutes + 1) * MINUTE_MS

    def _bucket(self, ms: int) -> int | None:
        index = (ms - self.first_minute_ms) // MINUTE_MS
        return index if 0 <= index < self.minutes else None

    def add(self, record: Record) -> bool:
        """Count *record*; ``False`` once `max_records` were read (the snapshot is partial)."""
        if self.records >= self.max_records:
            self.partial = True
            return False
        self.records += 1
        status = record.status.value
        self.by_status[status] += 1
        self.by_scope.setdefault(_scope(record.key), Counter())[status] += 1
        started = self._bucket(record.created_at_ms)
        if started is not None:
            self.started[started] += 1
        if record.status in (Status.COMPLETED, Status.FAILED):
            finished = self._bucket(record.updated_at_ms)
            if finished is not None:
                self.finished[finished] += 1
        if record.attempt > 1:
            retried = self._bucket(record.updated_at_ms)
            if retried is not None:
                self.retried[retried] += 1
        if record.status is Status.IN_PROGRESS and record.lease_expires_at_ms <= self.now_ms:
            self.stuck_count += 1
            if len(self.stuck) < self.max_listed:
                self.stuck.append(
                    {
                        "key": record.key,
                        "token": record.token,
                        "attempt": record.attempt,
                        "lapsed_ms": self.now_ms - record.lease_expires_at_ms,
                    }
                )
        return True

    def as_json(self, outbox: dict[str, Any] | None = None) -> dict[str, Any]:
        """The snapshot as the page and ``/api/snapshot`` read it."""
        scopes = sorted(self.by_scope.items(), key=lambda item: (-sum(item[1].values()), item[0]))
        return {
            "now_ms": self.now_ms,
            "records": self.records,
            "partial": self.partial,
            "by_status": {status.value: self.by_status[status.value] for status in Status},
            "by_scope": [
                {"scope": scope, "total": sum(counts.values()), **dict(counts)}
                for scope, counts in scopes[:100]
            ],
            "scopes": len(self.by_scope),
            "stuck": sorted(self.stuck, key=lambda lease: -int(lease["lapsed_ms"])),
            "stuck_count": self.stuck_count,
            "series": {
                "first_minute_ms": self.first_minute_ms,
                "minute_ms": MINUTE_MS,
                "started": self.started,
                "finished": self.finished,
                "retried": self.retried,
            },
            "outbox": outbox,
        }

    def prometheus(self, outbox: dict[str, Any] | None = None) -> str:
        """The snapshot's gauges in the Prometheus text format (version 0.0.4)."""
        lines = [
            "# HELP oncely_records Live records in the store, by status.",
            "# TYPE oncely_records gauge",
            *(
                f'oncely_records{{status="{status.value}"}} {self.by_status[status.value]}'
                for status in Status
            ),
            "# HELP oncely_stuck_leases In-progress records whose lease lapsed without a settle.",
            "# TYPE oncely_stuck_leases gauge",
            f"oncely_stuck_leases {self.stuck_count}",
            "# HELP oncely_dashboard_partial 1 when the snapshot read only part of the records.",
            "# TYPE oncely_dashboard_partial gauge",
            f"oncely_dashboard_partial {int(self.partial)}",
        ]
        if outbox is not None:
            for name in ("pending", "dead", "published"):
                if isinstance(outbox.get(name), int):
                    lines += [
                        f"# TYPE oncely_outbox_{name}_events gauge",
                        f"oncely_outbox_{name}_events {outbox[name]}",
                    ]
        return "\n".join(lines) + "\n"


def activity_gauges(activity: dict[str, Any]) -> str:
    """The recorded activity (`oncely.observe.activity.Activity.as_json`) as Prometheus gauges:
    each kind's count in the last complete minute and over the dashboard's window.

    Gauges, not counters: they are read back from what every process recorded, over a window
    that slides (each process's own counters are `oncely.observe.prometheus`'s).
    """
    if "error" in activity:
        return "# oncely activity unavailable\n"
    per_minute = "oncely_activity_last_minute_operations"
    window = "oncely_activity_window_operations"
    lines = [
        f"# HELP {per_minute} Operations of each kind in the last complete minute, all "
        "processes that record activity.",
        f"# TYPE {per_minute} gauge",
    ]
    for kind in KINDS:
        series = activity.get(kind) or [0, 0]
        last = series[-2] if len(series) > 1 else 0
        lines.append(f'{per_minute}{{kind="{kind}"}} {last}')
    lines += [
        f"# HELP {window} Operations of each kind over the dashboard's window.",
        f"# TYPE {window} gauge",
    ]
    for kind in KINDS:
        lines.append(f'{window}{{kind="{kind}"}} {sum(activity.get(kind) or ())}')
    return "\n".join(lines) + "\n"
