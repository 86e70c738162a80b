"""Process-wide switches the decorator reads on each call: set by `oncely.testing`, or by the
``ONCELY_DISABLED`` environment variable in an emergency."""

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
"""When true, decorated functions run unprotected (every call logs a warning)."""

store: Any = None
"""When set, every decorated function uses this store instead of its own."""


def warn_unprotected(name: str, **extra: Any) -> None:
    """Say that *name* (a scope, a key) runs unprotected because oncely is disabled."""
    get_logger("oncely").warning(
        "oncely is DISABLED (%s): %s runs UNPROTECTED",
        DISABLED_VARIABLE,
        name,
        extra=fields(outcome="unprotected", **extra),
    )
