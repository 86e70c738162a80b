"""The Django payments API with async views, under Django's ASGI handler, and oncely in
``settings.MIDDLEWARE``.

Every layer of the stack is async capable, so Django calls `oncely.http.django.
IdempotencyMiddleware` in its async mode: it awaits the store's async verbs on the event loop
(no thread per request) and reads the user with ``request.auser()``. The settings are those of
``django_middleware_app.py``. Run it: ``python examples/http/django_async_app.py --port 8000``
(needs django and uvicorn).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import django_app
import django_middleware_app
from _payments import Ledger, Simulation, main, parse_payment
from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

import oncely
from oncely.http import HttpPolicy, idempotent_route

MIDDLEWARE = [
    f"{__name__}.AsyncViewsMiddleware",
    *django_middleware_app.MIDDLEWARE,
]


class AsyncViewsMiddleware:
    """Routes this app's requests to the async views below (``request.urlconf``): the Django
    examples share one process's settings, whose ``ROOT_URLCONF`` has the sync views."""

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: Any) -> Any:
        request.urlconf = __name__
        return await self.get_response(request)


async def charge(request: HttpRequest) -> HttpResponse:
    simulation = Simulation.from_query(request.GET)
    payment = parse_payment(request.body, request.content_type or "")
    if payment is None:
        return django_app.not_a_payment()
    await asyncio.sleep(simulation.delay)
    return django_app.charge_and_answer(simulation, payment)


@csrf_exempt
@require_POST
async def create_payment(request: HttpRequest) -> HttpResponse:
    return await charge(request)


@csrf_exempt
@require_POST
@idempotent_route(require_key=True)
async def create_transfer(request: HttpRequest) -> HttpResponse:
    return await charge(request)


@idempotent_route(fail_open=True)
@csrf_exempt
@require_POST
async def receive_webhook(request: HttpRequest) -> HttpResponse:
    return await charge(request)


@csrf_exempt
@require_http_methods(["GET", "PUT"])
async def payment(request: HttpRequest, payment_id: int) -> HttpResponse:
    return django_app.payment_resource(request, payment_id)


urlpatterns = [
    path("payments", create_payment),
    path("payments/<int:payment_id>", payment),
    path("transfers", create_transfer),
    path("webhooks", receive_webhook),
]


def create_app(store: oncely.AsyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Any:
    """Django's ASGI handler with the middleware in its stack (the ledger is process-wide)."""
    from django.core.handlers.asgi import ASGIHandler
    from django.test.utils import override_settings

    django_app.LEDGER, django_app.ASGI = ledger, True
    # The middleware reads its settings when Django builds the stack, here.
    with override_settings(MIDDLEWARE=MIDDLEWARE, ONCELY_STORE=store, ONCELY_HTTP=policy):
        return ASGIHandler()


if __name__ == "__main__":
    main("asgi", create_app, __doc__.splitlines()[0])
