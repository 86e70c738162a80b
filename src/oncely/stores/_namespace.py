"""How the SQL and memory stores name a (namespace, key) pair in their one table of records.

The stored key must be injective: namespace ``billing`` with key ``eu:x`` and namespace
``billing:eu`` with key ``x`` are two records, and neither is the default namespace's key
``billing:eu:x``. So:

- in a named namespace it is ``<namespace>:<key>``, with ``%``, ``:`` and ``|`` in the namespace
  percent-escaped: the first ``:`` ends the namespace, and no ``|`` comes before it;
- in the default namespace it is the key itself, unless the key starts with ``|`` or has a ``:``
  with no ``|`` before it (it would look like a named namespace's): then ``|`` + the key.

A stored key belongs to the default namespace exactly when it has no ``:`` or a ``|`` before
its first ``:``. Both forms are what earlier versions stored (``<namespace>:<key>``, or the key)
whenever the namespace has none of ``%:|`` and a default-namespace key has a ``|`` before any
``:`` (as every key the entry points scope, ``<scope>|<key>``, does unless the scope has a
``:``): existing records in those cases are read as before. Others are not found after an
upgrade (their operations would run again): see the stores guide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

__all__ = ["caller_key", "in_default_namespace", "member", "namespace_range", "stored_key"]

_ESCAPES: Final = (("%", "%25"), (":", "%3A"), ("|", "%7C"))


def _escape(namespace: str) -> str:
    for plain, escaped in _ESCAPES:
        namespace = namespace.replace(plain, escaped)
    return namespace


def stored_key(namespace: str, key: str) -> str:
    """Return the stored form of *key* in *namespace* (``""`` is the default namespace)."""
    if namespace:
        return f"{_escape(namespace)}:{key}"
    if key.startswith("|") or (":" in key and "|" not in key.partition(":")[0]):
        return "|" + key
    return key


def caller_key(namespace: str, stored: str) -> str:
    """Return the key whose stored form in *namespace* is *stored* (the inverse of
    `stored_key`)."""
    if namespace:
        return stored[len(_escape(namespace)) + 1 :]
    return stored[1:] if stored.startswith("|") else stored


def in_default_namespace(stored: str) -> bool:
    """Whether *stored* is a key of the default namespace (not of a named one)."""
    head, colon, _ = stored.partition(":")
    return not colon or "|" in head


def namespace_range(namespace: str) -> tuple[str, str]:
    """Return the bounds ``(low, high)``: a named namespace's stored keys are exactly the
    strings ``s`` with ``low <= s < high`` (in code point order)."""
    head = _escape(namespace)
    return head + ":", head + ";"  # ";" follows ":"


def member(namespace: str) -> Callable[[str], bool]:
    """Return a test of whether a stored key belongs to *namespace*."""
    if not namespace:
        return in_default_namespace
    low, high = namespace_range(namespace)
    return lambda stored: low <= stored < high
