"""The Django payments API of ``django_app.py`` with oncely in ``settings.MIDDLEWARE``.

`oncely.http.django.IdempotencyMiddleware` runs inside Django, after authentication, so
``request.user`` names the principal of a key. The settings it reads::

    MIDDLEWARE = [..., "oncely.http.django.IdempotencyMiddleware"]
    ONCELY_STORE_URL = "sqlite:///oncely.db"   # or ONCELY_STORE = a store object
    ONCELY_HTTP = {"lease": 30}                 # HttpPolicy options (or an HttpPolicy)

Here a stand-in for ``django.contrib.auth`` (which needs a database) authenticates whoever the
``X-User`` header names. Run it: ``python examples/http/django_middleware_app.py --port 8000``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import django_app
from _payments import Ledger, main
from asgiref.sync import iscoroutinefunction, markcoroutinefunction

import oncely
from oncely.http import HttpPolicy

MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    f"{__name__}.HeaderUserMiddleware",
    "oncely.http.django.IdempotencyMiddleware",
]


@dataclass(frozen=True)
class HeaderUser:
    """An authenticated user, as ``request.user`` is after Django's AuthenticationMiddleware."""

    pk: str
    is_authenticated: bool = True


class HeaderUserMiddleware:
    """Sets ``request.user`` and ``request.auser`` from ``X-User`` (a stand-in for Django's
    authentication, which sets both); sync and async capable, as Django's is."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        name = request.headers.get("x-user")
        if name:
            user = HeaderUser(name)

            async def auser() -> HeaderUser:
                return user

            request.user, request.auser = user, auser
        return self.get_response(request)  # in an async stack, the coroutine to await


def create_app(store: oncely.SyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Any:
    """Django's WSGI handler with the middleware in its stack (the ledger is process-wide)."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.test.utils import override_settings

    django_app.LEDGER, django_app.ASGI = ledger, False
    # The middleware reads its settings when Django builds the stack, here.
    with override_settings(MIDDLEWARE=MIDDLEWARE, ONCELY_STORE=store, ONCELY_HTTP=policy):
        return _with_length(WSGIHandler())


def _with_length(app: Any) -> Any:
    """Django reads no request body without ``Content-Length``: buffer a chunked one (a server
    that marks its input terminated) and give it a length, so Django's views see it."""

    def call(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("wsgi.input_terminated") and not environ.get("CONTENT_LENGTH"):
            body = environ["wsgi.input"].read()
            environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        return app(environ, start_response)

    return call


if __name__ == "__main__":
    main("wsgi", create_app, __doc__.splitlines()[0])
