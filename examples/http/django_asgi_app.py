"""The Django payments API of ``django_app.py`` under Django's ASGI handler, protected by
oncely's ASGI middleware.

Run it: ``python examples/http/django_asgi_app.py --port 8000`` (needs django and uvicorn).
The views and their `idempotent_route` options are those of ``django_app.py``: the ASGI
middleware resolves Django's routes as the WSGI one does.
"""

from __future__ import annotations

from typing import Any

import django_app
from _payments import Ledger, main

import oncely
from oncely.http import HttpPolicy
from oncely.http.asgi import IdempotencyMiddleware


def create_app(store: oncely.AsyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Any:
    """Django's ASGI handler wrapped in the middleware (the ledger is process-wide)."""
    from django.core.asgi import get_asgi_application

    django_app.LEDGER, django_app.ASGI = ledger, True
    return IdempotencyMiddleware(get_asgi_application(), store=store, policy=policy)


if __name__ == "__main__":
    main("asgi", create_app, __doc__.splitlines()[0])
