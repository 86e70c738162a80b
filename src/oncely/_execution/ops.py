"""The operations a flow yields, for a driver (`oncely._execution.drivers`) to perform."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oncely._execution.lease import Lease

__all__ = ["Invoke", "Sleep", "StartHeartbeat", "StopHeartbeat", "StoreCall"]


@dataclass(frozen=True, slots=True)
class StoreCall:
    """Call store verb *verb* (``aclaim`` for async callers) with these arguments.

    With *shield*, an async caller cancelled while the call is in flight lets it finish first
    (then the flow gets the cancellation): a result that must be recorded is not dropped.
    """

    verb: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    shield: bool = False


@dataclass(frozen=True, slots=True)
class Invoke:
    """Run the protected function under *lease* and send back what it returns."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class Sleep:
    """Pause for *seconds*."""

    seconds: float


@dataclass(frozen=True, slots=True)
class StartHeartbeat:
    """Start extending the lease of *state* until `StopHeartbeat`."""

    state: Lease


@dataclass(frozen=True, slots=True)
class StopHeartbeat:
    """Stop the heartbeat of *state*, waiting for an extend in flight."""

    state: Lease
