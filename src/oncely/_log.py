"""oncely's loggers: the values a log line interpolates are escaped before it is formatted.

Keys, scopes, paths and error messages can come from untrusted clients. Written as they are, a
key holding a newline would forge a second log line (``...\\nCRITICAL payment refunded``). Every
module logs through `get_logger`, whose filter replaces each argument that does not print as one
line by its escaped form (the ``repr`` spelling without quotes), so one call is one line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

_PLAIN = (int, float, type(None))


def get_logger(name: str) -> logging.Logger:
    """Return the logger *name* with oncely's escaping filter attached (once)."""
    logger = logging.getLogger(name)
    if _ESCAPE not in logger.filters:
        logger.addFilter(_ESCAPE)
    return logger


def escape(text: str) -> str:
    """*text* as one printable line: control and other non-printable characters escaped."""
    return text if text.isprintable() else repr(text)[1:-1]


class _Escaped:
    """An object argument whose ``str`` and ``repr`` are escaped when the line is formatted."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return escape(str(self.value))

    def __repr__(self) -> str:
        return escape(repr(self.value))


def _safe(value: Any) -> Any:
    if type(value) is str and value.isprintable():
        return value
    if isinstance(value, _PLAIN):  # numbers keep working with %d and %.2f
        return value
    return _Escaped(value)


class _EscapeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe(arg) for arg in args)
        elif isinstance(args, Mapping):
            record.args = {name: _safe(value) for name, value in args.items()}
        return True


_ESCAPE = _EscapeFilter()
