"""Process-wide switches every entry point reads on each call (a module attribute: no cost to
speak of): set by `oncely.testing`, or by the ``ONCELY_DISABLED`` environment variable in an
emergency."""

from __future__ import annotations

import os
from typing import Any

from oncely._log import fields, get_logger

DISABLED_VARIABLE = "ONCELY_DISABLED"

disabled: bool = os.environ.get(DISABLED_VARIABLE, "").strip().lower() not in (
    "",
    "0",
    "false",
    "no",
)
"""When true, every entry point runs its operation unprotected, touching no store (every call
logs a warning): the decorator, `Guard`, the inbox, the HTTP middlewares and client transport,
and the consumers."""

store: Any = None
"""When set, every decorated function uses this store instead of its own."""

REFERENCE_FLOWS_VARIABLE = "ONCELY_REFERENCE_FLOWS"

reference_flows: bool = os.environ.get(REFERENCE_FLOWS_VARIABLE, "").strip().lower() not in (
    "",
    "0",
    "false",
    "no",
)
"""When true, every entry point with a hand-inlined fast path (the decorator's ``call`` and
``acall``, the async driver, the ASGI middleware, the async consumer, the outbox relay's first
try at a claim on PostgreSQL) takes the reference flow instead, so that the test suite can hold
both to the same tests."""


def warn_unprotected(name: str, **extra: Any) -> None:
    """Say that *name* (a scope, a key) runs unprotected because oncely is disabled."""
    get_logger("oncely").warning(
        "oncely is DISABLED (%s): %s runs UNPROTECTED",
        DISABLED_VARIABLE,
        name,
        extra=fields(outcome="unprotected", **extra),
    )


def off(method: str, target: object) -> bool:
    """Whether oncely is disabled, for an HTTP entry point: if so, say that the request
    *method* *target* runs unprotected (the caller passes it straight through)."""
    if not disabled:
        return False
    warn_unprotected(f"{method} {target}")
    return True
