"""How one protected operation behaves: retention, lease, conflicts and final errors."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Final, Literal, TypeAlias

from oncely.errors import ConfigurationError

__all__ = ["UNSET", "Duration", "Policy", "derive", "to_timedelta"]

Duration: TypeAlias = timedelta | int | float
"""A duration: a `timedelta`, or a number of seconds."""


MIN_HEARTBEAT_LEASE: Final = timedelta(milliseconds=30)
"""The shortest lease a heartbeat can keep alive (it extends every third of the lease)."""


def to_timedelta(value: Duration, name: str) -> timedelta:
    """Normalise a duration given as a timedelta or seconds, rejecting nonsense early."""
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise ConfigurationError(
            f"{name} must be a timedelta or a number of seconds, not {value!r}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a finite number of seconds, not {value!r}")
    try:
        result = value if isinstance(value, timedelta) else timedelta(seconds=value)
    except OverflowError:
        raise ConfigurationError(f"{name} is too long: {value!r} seconds") from None
    if result <= timedelta(0):
        raise ConfigurationError(f"{name} must be positive, not {value!r}")
    return result


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How one protected operation behaves. Immutable: derive variants with `dataclasses.replace`.

    Attributes:
        ttl: How long a finished outcome is replayed.
        lease: How long a worker may run before others may take over (kept alive by the
            heartbeat while the operation runs).
        on_conflict: ``"raise"`` an `InProgressError` for a concurrent duplicate, or ``"wait"``
            up to *wait_timeout* for the first call's outcome.
        wait_timeout: The bound on waiting with ``on_conflict="wait"``.
        final_errors: Exception types that are stored and replayed as the same type; any other
            exception releases the lease so a retry executes.
        heartbeat: Extend the lease every third of it while the operation runs.

    .. versionadded:: 0.1.0
    """

    ttl: timedelta = timedelta(hours=24)
    lease: timedelta = timedelta(seconds=30)
    on_conflict: Literal["raise", "wait"] = "raise"
    wait_timeout: timedelta = timedelta(seconds=10)
    final_errors: tuple[type[BaseException], ...] = field(default=())
    heartbeat: bool = True

    def __post_init__(self) -> None:
        for name in ("ttl", "lease", "wait_timeout"):
            object.__setattr__(self, name, to_timedelta(getattr(self, name), name))
        if self.ttl < self.lease:
            raise ConfigurationError("ttl must not be shorter than the lease")
        if self.heartbeat and self.lease < MIN_HEARTBEAT_LEASE:
            raise ConfigurationError(
                f"a lease of {self.lease.total_seconds() * 1000:g} ms is too short to keep alive "
                f"with a heartbeat (at least {MIN_HEARTBEAT_LEASE.total_seconds() * 1000:g} ms), "
                "or pass heartbeat=False"
            )
        if self.on_conflict not in ("raise", "wait"):
            raise ConfigurationError(
                f"on_conflict must be 'raise' or 'wait', not {self.on_conflict!r}"
            )
        errors = self.final_errors
        if isinstance(errors, type):
            errors = (errors,)
        errors = tuple(errors)
        for error in errors:
            if not (isinstance(error, type) and issubclass(error, BaseException)):
                raise ConfigurationError(f"final_errors must be exception types, not {error!r}")
        object.__setattr__(self, "final_errors", errors)


class _Unset(enum.Enum):
    """The type of `UNSET`: an option that was not given, as opposed to one given as None."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset.UNSET
"""Marks an option left at the policy's value."""


def derive(policy: Policy | None, **overrides: Any) -> Policy:
    """Return *policy* (or the default) with the overrides that were actually given."""
    base = policy if policy is not None else Policy()
    if not isinstance(base, Policy):
        raise ConfigurationError(f"policy must be an oncely.Policy, not {base!r}")
    given = {name: value for name, value in overrides.items() if value is not UNSET}
    return replace(base, **given) if given else base
