"""ASGI and WSGI type aliases, defined here so that no framework is imported (as in Starlette)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from types import TracebackType
from typing import Any, TypeAlias

__all__ = [
    "ASGIApp",
    "ExcInfo",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "StartResponse",
    "WSGIApp",
    "WSGIEnviron",
]

Scope: TypeAlias = MutableMapping[str, Any]
"""An ASGI connection scope."""

Message: TypeAlias = MutableMapping[str, Any]
"""An ASGI event message."""

Receive: TypeAlias = Callable[[], Awaitable[Message]]
"""The ASGI ``receive`` callable."""

Send: TypeAlias = Callable[[Message], Awaitable[None]]
"""The ASGI ``send`` callable."""

ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI 3 application."""

WSGIEnviron: TypeAlias = dict[str, Any]
"""A WSGI environ."""

ExcInfo: TypeAlias = tuple[type[BaseException], BaseException, TracebackType | None]
"""What ``sys.exc_info()`` returns while an exception is handled."""

StartResponse: TypeAlias = Callable[..., Callable[[bytes], object]]
"""The WSGI ``start_response(status, headers, exc_info=None)`` callable."""

WSGIApp: TypeAlias = Callable[[WSGIEnviron, StartResponse], Iterable[bytes]]
"""A WSGI application."""
