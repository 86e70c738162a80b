"""oncely's loggers: the values a log line interpolates are escaped before it is formatted.

Keys, scopes, paths and error messages can come from untrusted clients. Written as they are, a
key holding a newline would forge a second log line (``...\\nCRITICAL payment refunded``). Every
module logs through `get_logger`, whose filter replaces each argument that does not print as one
line by its escaped form (the ``repr`` spelling without quotes), so one call is one line.

The main lines also carry structured fields in ``extra`` (`fields`): ``oncely_key`` (the stored
key), ``oncely_scope`` (its scope part), ``oncely_token``, ``oncely_attempt``, ``oncely_store``
(the store's class name) and ``oncely_outcome`` where known, so JSON formatters and structlog
pick them up. Their string values are escaped like the arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from enum import Enum
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


def fields(
    *,
    key: str | None = None,
    scope: str | None = None,
    token: int | None = None,
    attempt: int | None = None,
    store: object = None,
    outcome: object = None,
) -> Mapping[str, Any]:
    """The ``extra`` of a log call: oncely's structured fields, named ``oncely_<field>``.

    Nothing is computed here: the mapping is read only when a record is made, that is when the
    logger is enabled for the level, and escapes its strings then.
    """
    return _Fields(key, scope, token, attempt, store, outcome)


class _Fields(Mapping[str, Any]):
    __slots__ = ("_given", "_made")

    def __init__(
        self,
        key: str | None,
        scope: str | None,
        token: int | None,
        attempt: int | None,
        store: object,
        outcome: object,
    ) -> None:
        self._given = (key, scope, token, attempt, store, outcome)
        self._made: dict[str, Any] | None = None

    def _values(self) -> dict[str, Any]:
        if self._made is None:
            key, scope, token, attempt, store, outcome = self._given
            made: dict[str, Any] = {}
            if key is not None:
                made["oncely_key"] = escape(key)
                if scope is None and "|" in key:  # a scope never holds "|": "<scope>|<key>"
                    scope = key.partition("|")[0]
            if scope is not None:
                made["oncely_scope"] = escape(scope)
            if token is not None:
                made["oncely_token"] = token
            if attempt is not None:
                made["oncely_attempt"] = attempt
            if store is not None:
                made["oncely_store"] = escape(type(store).__name__)
            if outcome is not None:
                made["oncely_outcome"] = escape(_plain(outcome))
            self._made = made
        return self._made

    def __getitem__(self, name: str) -> Any:
        return self._values()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())


def _plain(value: object) -> str:
    return str(value.value) if isinstance(value, Enum) else str(value)


class _EscapeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe(arg) for arg in args)
        elif isinstance(args, Mapping):
            record.args = {name: _safe(value) for name, value in args.items()}
        return True


_ESCAPE = _EscapeFilter()
