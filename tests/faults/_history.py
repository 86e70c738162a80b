"""The history of one fault-injected run: what the clients saw and what the handlers did.

Every record is a plain dict (it crosses a process pipe): ``ev`` names its kind.

- ``invoke``: a client starts operation ``op`` on ``key`` (``worker``, ``t``).
- ``run``: the protected handler started for ``op`` with fencing ``token`` (``t``).
- ``effect``: the handler's fenced write for ``op`` was ``accepted`` or rejected (``t``).
- ``end``: the handler returned or raised (``t``).
- ``ok`` / ``fail``: the client got a result (``value``) or an error (``error``, its type).
- ``fault``: the campaign injected ``kind`` on ``op`` (``excuses``: the op's worker stopped
  being a live lease holder, so another may take its key over).
- ``ack``: a consumer acknowledged the message ``key`` (read from the broker, for the broker
  adapters).
- ``settled``, ``revoked``: what a consumer member saw (it acked ``key``; the group revoked its
  partitions, ``mid``: with handlers in flight): the campaign waits on them, the checker does
  not read them.

An ``invoke`` with neither ``ok`` nor ``fail`` is an *unknown* outcome (the client died or
timed out), as is a ``fail`` whose error says the outcome is not known.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]

UNKNOWN_ERRORS = frozenset(
    {
        "StoreUnavailableError",
        "TimeoutError",
        "ReadTimeout",
        "killed",
        "ResultUnavailableError",
        "OutcomeUnknownError",
        "OwnedByAnotherPrincipal",
    }
)
"""Client errors that leave the outcome unknown: the operation may or may not have run."""

FINAL_ERRORS = frozenset(
    {"ResultUnavailableError", "OutcomeUnknownError", "OwnedByAnotherPrincipal"}
)
"""Client errors that end the client's story: the operation ran (or may have) and will not run
again, but its result cannot be had (a response cut short is never replayed, by design; a key
that a client's refreshed credentials no longer own is refused, never run again)."""


def now() -> float:
    """A timestamp comparable across the processes of one host (CLOCK_MONOTONIC)."""
    return time.monotonic()


@dataclass
class History:
    """The events of one history, with what the checker needs to judge them."""

    name: str
    ttl: float = 3600.0
    """The record ttl in seconds: a key may run again once its outcome has expired."""
    lease: float = 0.0
    """The lease in seconds: a claim whose reply was lost may hold its key that long."""
    events: list[Event] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    """The keys the history's clients must end with a result for."""

    def add(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: str) -> list[Event]:
        return [event for event in self.events if event["ev"] == kind]
