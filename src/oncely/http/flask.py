"""Flask: the usual extension form around oncely's WSGI middleware.

.. code-block:: python

    from flask import Flask
    from oncely.http.flask import Idempotency

    idempotency = Idempotency()            # at import time, in an extensions module

    def create_app() -> Flask:
        app = Flask(__name__)
        app.config["ONCELY_STORE_URL"] = "postgresql://app@db/app"
        idempotency.init_app(app)
        return app

Nothing here imports Flask: the app is used through ``wsgi_app``, ``config`` and
``extensions``, as every Flask app has them.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oncely._core.protocols import SyncStore
from oncely.errors import ConfigurationError
from oncely.http._policy import HttpPolicy, RouteOptions
from oncely.http._routes import RouteResolver
from oncely.http.wsgi import IdempotencyMiddleware
from oncely.stores import open_store

__all__ = ["Idempotency"]

STORE_URL_SETTING = "ONCELY_STORE_URL"
"""The app config key naming the store when no store is given."""


class Idempotency:
    """Protect a Flask app's unsafe requests with the ``Idempotency-Key`` middleware.

    Args:
        app: The Flask app; or leave it out and call `init_app` later (app factories).
        store: The store, or a store URL. Without one, ``app.config["ONCELY_STORE_URL"]``
            names it when `init_app` runs.
        policy: The app-wide `HttpPolicy`.
        routes: `RouteOptions` by path pattern, as for the WSGI middleware; views decorated
            with `oncely.http.idempotent_route` override them.
        resolver: How a request's route is found (Flask routing by default).

    Raises:
        ConfigurationError: At `init_app`, when no store is given or configured, or the app
            was initialised already.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        app: Any = None,
        *,
        store: SyncStore | str | None = None,
        policy: HttpPolicy | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
        resolver: RouteResolver | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.routes = routes
        self.resolver = resolver
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Any) -> IdempotencyMiddleware:
        """Wrap ``app.wsgi_app`` with the middleware; return the middleware."""
        extensions = app.extensions
        if "oncely" in extensions:
            raise ConfigurationError("oncely's Idempotency was already initialised on this app")
        store = self.store if self.store is not None else app.config.get(STORE_URL_SETTING)
        if store is None:
            raise ConfigurationError(
                f"no store: pass store= to Idempotency or set app.config[{STORE_URL_SETTING!r}]"
            )
        if isinstance(store, str):
            store = open_store(store)
        middleware = IdempotencyMiddleware(
            app.wsgi_app,
            store=store,
            policy=self.policy,
            routes=self.routes,
            resolver=self.resolver,
        )
        app.wsgi_app = middleware
        extensions["oncely"] = middleware
        return middleware
