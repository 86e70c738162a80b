"""Replays, duplicates, mismatches and refusals per minute, shared by every process via the store.

A store's records say what ran; they do not say how often a duplicate was answered from them.
`record_activity` subscribes to the event stream, counts the operations worth watching by minute,
scope and kind, keeps the last mismatches and refusals, and flushes both to the store every few
seconds (and at exit) in one round trip. Any process (the dashboard's, ``oncely dashboard``)
reads them back with `read_activity`.

.. code-block:: python

    import oncely
    import oncely.observe

    store = oncely.open_store("redis://localhost:6379/0")
    recorder = oncely.observe.record_activity(store)  # once, at startup

Where it is kept: Redis (and Redis Cluster) per-minute hashes and a capped list, expiring after
*retention*; PostgreSQL and SQLite two small tables (``oncely_activity`` and
``oncely_activity_recent``, created on first use or by `migrate_activity`); ``memory://`` and
SQLite ``:memory:`` a dict of this process. A flush that fails never reaches the application's
calls: it is logged, counted (`ActivityRecorder.failures`), and its counts are kept for the next.

What is recorded never holds a key or a payload: the events carry neither. Times are this
process's clock, bucketed by minute.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol, TypeAlias

from oncely import _events
from oncely._log import get_logger
from oncely.errors import ConfigurationError

__all__ = [
    "KINDS",
    "Activity",
    "ActivityRecorder",
    "Kind",
    "Recent",
    "migrate_activity",
    "read_activity",
    "record_activity",
]

logger = get_logger("oncely.observe")

MINUTE_MS = 60_000

Kind: TypeAlias = Literal["replayed", "duplicate", "in_progress", "mismatch", "refused"]
"""What is counted: a call or request answered from its record (``replayed``), a consumed or
inbox message found already handled (``duplicate``), turned away while the first runs
(``in_progress``), for another payload (``mismatch``), or for a missing or invalid key
(``refused``)."""

KINDS: tuple[Kind, ...] = ("replayed", "duplicate", "in_progress", "mismatch", "refused")
_LISTED: frozenset[str] = frozenset({"mismatch", "refused"})
_COUNTED: frozenset[str] = frozenset({"replayed", "in_progress", "mismatch", "refused"})
_MESSAGES: frozenset[str] = frozenset({"consumer", "inbox"})

CountKey: TypeAlias = tuple[int, str, str]
"""(minute since the epoch, scope, kind)."""
RecentRow: TypeAlias = tuple[int, str, str, str, str]
"""(epoch ms, scope, surface, kind, reason)."""


@dataclass(frozen=True, slots=True)
class Recent:
    """One recent mismatch or refusal.

    Attributes:
        at_ms: When it was reported (epoch milliseconds, the reporting process's clock).
        scope: The key's scope (never the key).
        surface: Which kind of entry point turned it away.
        kind: ``mismatch`` or ``refused``.
        reason: The error's class name, or the surface's detail (an HTTP status, a verdict).
    """

    at_ms: int
    scope: str
    surface: str
    kind: str
    reason: str


@dataclass(frozen=True, slots=True)
class Activity:
    """What `read_activity` returns: counts per minute by kind and scope, and the recent list.

    Attributes:
        first_minute_ms: The start of the first minute of every series.
        minutes: How many minutes each series covers (the last one is the current minute).
        series: Counts per minute for each of `KINDS`, all scopes together.
        by_scope: Totals over the period by scope, then by kind.
        recent: The last mismatches and refusals, newest first.
    """

    first_minute_ms: int
    minutes: int
    series: Mapping[str, list[int]]
    by_scope: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    recent: Sequence[Recent] = ()

    def as_json(self) -> dict[str, Any]:
        """The activity as ``/api/snapshot`` carries it."""
        return {
            "first_minute_ms": self.first_minute_ms,
            "minute_ms": MINUTE_MS,
            **{kind: list(self.series.get(kind, [0] * self.minutes)) for kind in KINDS},
            "totals": {kind: sum(self.series.get(kind, ())) for kind in KINDS},
            "by_scope": [
                {"scope": scope, **dict(counts)}
                for scope, counts in sorted(
                    self.by_scope.items(), key=lambda item: (-sum(item[1].values()), item[0])
                )[:100]
            ],
            "recent": [
                {
                    "at_ms": each.at_ms,
                    "scope": each.scope,
                    "surface": each.surface,
                    "kind": each.kind,
                    "reason": each.reason,
                }
                for each in self.recent
            ],
        }


def activity_of(
    rows: Sequence[tuple[int, str, str, int]],
    recent: Sequence[RecentRow],
    *,
    now_ms: int,
    minutes: int,
) -> Activity:
    """Fold stored rows (minute, scope, kind, count) into an `Activity` ending at *now_ms*."""
    last = now_ms // MINUTE_MS
    first = last - minutes + 1
    series: dict[str, list[int]] = {kind: [0] * minutes for kind in KINDS}
    by_scope: dict[str, dict[str, int]] = {}
    for minute, scope, kind, count in rows:
        if first <= minute <= last and kind in series:
            series[kind][minute - first] += count
            per_kind = by_scope.setdefault(scope, {})
            per_kind[kind] = per_kind.get(kind, 0) + count
    listed = [Recent(*row) for row in recent]
    listed.sort(key=lambda each: -each.at_ms)
    return Activity(first * MINUTE_MS, minutes, series, by_scope, listed)


class Tally:
    """Counts of this process not yet flushed, and its recent mismatches and refusals: pure.

    Args:
        max_counts: Distinct (minute, scope, kind) counts kept at most while flushes fail;
            past it new ones are dropped (and counted in `dropped`).
        max_recent: Recent mismatches and refusals kept at most.
    """

    def __init__(self, *, max_counts: int = 20_000, max_recent: int = 100) -> None:
        self.max_counts = max_counts
        self.counts: dict[CountKey, int] = {}
        self.recent: deque[RecentRow] = deque(maxlen=max_recent)
        self.dropped = 0
        self._lock = threading.Lock()

    def add(self, event: _events.Operation, now_ms: int) -> None:
        """Count *event* if its outcome is one of `KINDS`."""
        outcome = event.outcome
        if outcome == "replayed":
            kind = "duplicate" if event.surface in _MESSAGES else "replayed"
        elif outcome in ("in_progress", "mismatch", "refused"):
            kind = outcome
        else:
            return
        key = (now_ms // MINUTE_MS, event.operation or "(unscoped)", kind)
        with self._lock:
            count = self.counts.get(key)
            if count is not None:
                self.counts[key] = count + 1
            elif len(self.counts) < self.max_counts:
                self.counts[key] = 1
            else:
                self.dropped += 1
            if kind in _LISTED:
                reason = event.error or event.detail or ""
                self.recent.append((now_ms, key[1], event.surface, kind, reason))

    def drain(self) -> tuple[dict[CountKey, int], list[RecentRow]]:
        """Take everything counted so far (the tally starts empty again)."""
        with self._lock:
            counts, self.counts = self.counts, {}
            recent = list(self.recent)
            self.recent.clear()
        return counts, recent

    def restore(
        self, counts: Mapping[CountKey, int], recent: Sequence[RecentRow], oldest_minute: int
    ) -> None:
        """Put back what a failed flush took (minutes before *oldest_minute* are let go)."""
        with self._lock:
            for key, count in counts.items():
                if key[0] < oldest_minute:
                    continue
                if key in self.counts or len(self.counts) < self.max_counts:
                    self.counts[key] = self.counts.get(key, 0) + count
                else:
                    self.dropped += count
            newer = list(self.recent)
            self.recent.clear()
            self.recent.extend([*recent, *newer])  # the ring keeps the newest


class Sink(Protocol):
    """Where a store keeps activity: one implementation per backend."""

    def write(
        self,
        counts: Mapping[CountKey, int],
        recent: Sequence[RecentRow],
        *,
        now_ms: int,
        keep_minutes: int,
        keep_recent: int,
    ) -> None:
        """Add *counts* and *recent* in one round trip; forget what is older than kept."""

    def read(
        self, *, since_minute: int, until_minute: int, limit: int
    ) -> tuple[list[tuple[int, str, str, int]], list[RecentRow]]:
        """Counts of the minutes *since_minute* to *until_minute*, and the *limit* most recent
        events."""

    def close(self) -> None:
        """Let go of the sink's connection."""


class MemorySink:
    """Activity kept in this process (``memory://`` and SQLite ``:memory:`` stores)."""

    def __init__(self) -> None:
        self.counts: dict[CountKey, int] = {}
        self.recent: deque[RecentRow] = deque(maxlen=1000)
        self._lock = threading.Lock()

    def write(
        self,
        counts: Mapping[CountKey, int],
        recent: Sequence[RecentRow],
        *,
        now_ms: int,
        keep_minutes: int,
        keep_recent: int,
    ) -> None:
        """See `Sink.write`."""
        oldest = now_ms // MINUTE_MS - keep_minutes
        with self._lock:
            for key, count in counts.items():
                self.counts[key] = self.counts.get(key, 0) + count
            for key in [key for key in self.counts if key[0] < oldest]:
                del self.counts[key]
            self.recent.extend(recent)
            while len(self.recent) > keep_recent:
                self.recent.popleft()

    def read(
        self, *, since_minute: int, until_minute: int, limit: int
    ) -> tuple[list[tuple[int, str, str, int]], list[RecentRow]]:
        """See `Sink.read`."""
        with self._lock:
            rows = [
                (*key, count)
                for key, count in self.counts.items()
                if since_minute <= key[0] <= until_minute
            ]
            recent = list(self.recent)[-limit:] if limit > 0 else []
        return rows, recent

    def after_fork(self) -> None:
        """A forked child's copy gets a lock of its own."""
        self._lock = threading.Lock()

    def close(self) -> None:
        """Nothing to let go of."""


_memory_sinks: weakref.WeakKeyDictionary[Any, MemorySink] = weakref.WeakKeyDictionary()
_memory_lock = threading.Lock()


def _unwrapped(store: Any) -> Any:
    """The store under the wrappers (tiered cache, Bloom filter, timing) put around it."""
    for _ in range(8):
        inner = getattr(store, "inner", None) or getattr(store, "store", None)
        if inner is None or inner is store:
            break
        store = inner
    return store


def sink_for(store: Any) -> Sink:
    """The activity sink of *store*'s backend (its own connection, made from the store's)."""
    base = _unwrapped(store)
    backend = getattr(base, "backend", None)
    if backend == "redis":
        from oncely.stores.redis._activity import RedisActivity

        return RedisActivity.of(base)
    if backend == "postgres":
        from oncely.stores.postgres._activity import PostgresActivity

        return PostgresActivity.of(base)
    if backend == "sqlite" and str(getattr(base, "path", ":memory:")) != ":memory:":
        from oncely.stores.sqlite._activity import SQLiteActivity

        return SQLiteActivity.of(base)
    if backend in ("memory", "sqlite"):
        with _memory_lock:
            sink = _memory_sinks.get(base)
            if sink is None:
                sink = _memory_sinks[base] = MemorySink()
        return sink
    raise ConfigurationError(f"activity is kept in a oncely store, not in {store!r}")


class ActivityRecorder:
    """Counts this process's replays, duplicates, mismatches and refusals; flushes them.

    Made by `record_activity`; `close` (or the end of a ``with`` block) flushes and stops it.

    Attributes:
        flushes: Flushes that reached the store.
        failures: Flushes that failed (their counts were kept for the next).
    """

    def __init__(
        self,
        sink: Sink,
        *,
        interval: float,
        retention: timedelta,
        recent: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self.interval = interval
        self.keep_minutes = max(1, int(retention.total_seconds() // 60))
        self.keep_recent = recent
        self.tally = Tally(max_recent=recent)
        self.flushes = 0
        self.failures = 0
        self._clock = clock
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._unsubscribe = _events.subscribe(self._on_event)
        self._thread = threading.Thread(target=self._run, name="oncely-activity", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        _RECORDERS.add(self)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _after_fork(self) -> None:
        # A forked child (a pre-forking server's worker) starts counting afresh: what the parent
        # counted is the parent's to flush. Only the forking thread survives, maybe leaving a
        # lock held, so the locks and the flusher are new; the parent's connection is left to
        # the parent (see each sink's after_fork).
        self.tally = Tally(max_counts=self.tally.max_counts, max_recent=self.keep_recent)
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        after_fork = getattr(self.sink, "after_fork", None)
        if callable(after_fork):
            after_fork()
        if not self._closed:
            self._thread = threading.Thread(target=self._run, name="oncely-activity", daemon=True)
            self._thread.start()

    def _on_event(self, event: _events.Event) -> None:
        if type(event) is _events.Operation and event.outcome in _COUNTED:
            self.tally.add(event, int(self._clock() * 1000))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> bool:
        """Write what was counted since the last flush; ``False`` if the store failed (the
        counts are kept for the next flush)."""
        with self._flush_lock:
            counts, recent = self.tally.drain()
            if not counts and not recent:
                return True
            now_ms = self._now_ms()
            try:
                self.sink.write(
                    counts,
                    recent,
                    now_ms=now_ms,
                    keep_minutes=self.keep_minutes,
                    keep_recent=self.keep_recent,
                )
            except Exception as exc:
                self.failures += 1
                oldest = now_ms // MINUTE_MS - self.keep_minutes
                self.tally.restore(counts, recent, oldest)
                logger.warning(
                    "oncely could not flush its activity (kept for the next flush): %s: %s",
                    type(exc).__name__,
                    exc,
                )
                return False
            self.flushes += 1
            return True

    def close(self) -> None:
        """Stop counting, flush what is left, let go of the sink's connection."""
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # a flush under way: bounded by the store's timeouts
        self.flush()
        self.sink.close()
        atexit.unregister(self.close)

    def __enter__(self) -> ActivityRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_RECORDERS: weakref.WeakSet[ActivityRecorder] = weakref.WeakSet()


def _recorders_after_fork() -> None:
    for recorder in list(_RECORDERS):
        recorder._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_recorders_after_fork)


def record_activity(
    store: Any,
    *,
    interval: float = 10.0,
    retention: timedelta = timedelta(hours=6),
    recent: int = 100,
) -> ActivityRecorder:
    """Count this process's replays, duplicates, mismatches and refusals into *store*.

    Call it once per process, at startup; the dashboard (and `read_activity`) then sees every
    process's activity. Until it is called nothing is counted.

    Args:
        store: The store to keep the activity in (usually the one the app's records are in).
        interval: Seconds between flushes (one round trip each; nothing is sent when idle).
        retention: How long per-minute counts are kept.
        recent: How many recent mismatches and refusals are kept (for all processes).

    Raises:
        ConfigurationError: *store* is not one of oncely's stores, or an option is out of range.
    """
    if interval <= 0 or recent < 0 or retention < timedelta(minutes=1):
        raise ConfigurationError(
            "record_activity needs interval > 0, recent >= 0 and a retention of a minute or more"
        )
    return ActivityRecorder(sink_for(store), interval=interval, retention=retention, recent=recent)


def read_activity(
    store: Any, *, minutes: int = 180, recent: int = 50, now_ms: int | None = None
) -> Activity:
    """Every process's recorded activity in *store*: the last *minutes*, the *recent* newest
    mismatches and refusals.

    Raises:
        ConfigurationError: *store* is not one of oncely's stores.
        StoreError: The store failed (or, on PostgreSQL, no activity table exists yet and the
            store's role may not create it).
    """
    sink = sink_for(store)
    try:
        return read_sink(sink, minutes=minutes, recent=recent, now_ms=now_ms)
    finally:
        if not isinstance(sink, MemorySink):
            sink.close()


def read_sink(sink: Sink, *, minutes: int, recent: int, now_ms: int | None = None) -> Activity:
    """`read_activity` through a sink kept open (the dashboard reads every few seconds)."""
    if minutes < 1:
        raise ConfigurationError("minutes must be 1 or more")
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    last = now // MINUTE_MS
    rows, listed = sink.read(since_minute=last - minutes + 1, until_minute=last, limit=recent)
    return activity_of(rows, listed, now_ms=now, minutes=minutes)


def activity_schema_sql(store: Any) -> str:
    """The activity tables' DDL for *store* (PostgreSQL or SQLite; empty for the others), for
    ``oncely migrate --sql``. Opens no connection."""
    base = _unwrapped(store)
    backend = getattr(base, "backend", None)
    if backend == "postgres":
        from oncely.stores.postgres._activity import PostgresActivity

        return PostgresActivity(base._conninfo, {}, base.schema, base.namespace).schema_sql()
    if backend == "sqlite":
        from oncely.stores.sqlite._activity import SQLiteActivity

        return SQLiteActivity.schema_sql()
    return ""


def migrate_activity(store: Any) -> None:
    """Create the activity tables of a PostgreSQL or SQLite store now (idempotent).

    Recording creates them on first use too; call this where the application's role may not
    create tables and the migrating one may. Redis and memory stores need nothing.
    """
    sink = sink_for(store)
    try:
        migrate = getattr(sink, "migrate", None)
        if callable(migrate):
            migrate()
    finally:
        if not isinstance(sink, MemorySink):
            sink.close()
