"""A Django payments API (one file, no ORM) protected by oncely's WSGI middleware.

Run it: ``python examples/http/django_app.py --port 8000`` (needs django and waitress), then::

    curl -i -X POST localhost:8000/payments -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"amount": 500}'

The middleware wraps Django's WSGI handler. ``POST /transfers`` requires a key and
``POST /webhooks`` stays up when the store is down, both set on the view with
`idempotent_route`. Django's settings are process-wide, so the ledger is too.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import django
from _payments import (
    Ledger,
    Payment,
    SimulatedFailure,
    Simulation,
    adjustment,
    main,
    parse_payment,
    payment_headers,
)
from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

import oncely
from oncely.http import HttpPolicy, idempotent_route
from oncely.http.wsgi import IdempotencyMiddleware

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["*"],
        MIDDLEWARE=["django.middleware.common.CommonMiddleware"],
        APPEND_SLASH=False,
        LOGGING_CONFIG=None,
    )
    django.setup()

LEDGER: Ledger | None = None
"""The ledger of the app made last by `create_app`."""

ASGI = False
"""Whether the app made last runs under Django's ASGI handler (``django_asgi_app.py``)."""


def _ledger() -> Ledger:
    assert LEDGER is not None, "call create_app() first"
    return LEDGER


def charge(request: HttpRequest) -> HttpResponse:
    simulation = Simulation.from_query(request.GET)
    payment = parse_payment(request.body, request.content_type or "")
    if payment is None:
        return not_a_payment()
    time.sleep(simulation.delay)
    return charge_and_answer(simulation, payment)


def not_a_payment() -> HttpResponse:
    return JsonResponse({"error": "the body is not a payment object"}, status=400)


def charge_and_answer(simulation: Simulation, payment: Payment) -> HttpResponse:
    """Charge *payment* and answer as *simulation* asks (the views' shared second half)."""
    charged = _ledger().charge(payment)
    if simulation.fail == "raise":
        raise SimulatedFailure("the handler failed after charging")
    status = simulation.status
    content = simulation.body(charged)
    response: HttpResponse | StreamingHttpResponse
    if simulation.chunks == 1:
        response = HttpResponse(content, status=status, content_type="application/json")
    else:

        def pieces() -> Iterator[bytes]:
            yield from simulation.pieces(content)

        async def async_pieces() -> AsyncIterator[bytes]:
            for piece in simulation.pieces(content):
                yield piece

        # Django serves a sync iterator under ASGI (and an async one under WSGI) with a warning.
        stream = async_pieces() if ASGI else pieces()
        response = StreamingHttpResponse(stream, status=status, content_type="application/json")
        response["Content-Length"] = str(len(content))
    for name, value in payment_headers(charged["id"]):
        if name == "set-cookie":
            response.set_cookie("last_payment", str(charged["id"]), httponly=True)
        else:
            response[name] = value
    return response  # type: ignore[return-value]


@csrf_exempt
@require_POST
def create_payment(request: HttpRequest) -> HttpResponse:
    return charge(request)


@csrf_exempt
@require_POST
@idempotent_route(require_key=True)
def create_transfer(request: HttpRequest) -> HttpResponse:
    return charge(request)


@idempotent_route(fail_open=True)  # outermost works too: the options are found on the view
@csrf_exempt
@require_POST
def receive_webhook(request: HttpRequest) -> HttpResponse:
    return charge(request)


@csrf_exempt
@require_http_methods(["GET", "PUT"])
def payment(request: HttpRequest, payment_id: int) -> HttpResponse:
    return payment_resource(request, payment_id)


def payment_resource(request: HttpRequest, payment_id: int) -> HttpResponse:
    """``PUT`` records an adjustment, ``GET`` shows a payment."""
    if request.method == "PUT":
        return JsonResponse(_ledger().charge(adjustment(request.body)))
    found = _ledger().get(payment_id)
    if found is None:
        raise Http404
    return HttpResponse(json.dumps(found), content_type="application/json")


urlpatterns = [
    path("payments", create_payment),
    path("payments/<int:payment_id>", payment),
    path("transfers", create_transfer),
    path("webhooks", receive_webhook),
]


def create_app(store: oncely.SyncStore, ledger: Ledger, policy: HttpPolicy | None = None) -> Any:
    """Django's WSGI handler wrapped in the middleware (the ledger is process-wide)."""
    from django.core.wsgi import get_wsgi_application

    global ASGI, LEDGER
    LEDGER, ASGI = ledger, False
    return IdempotencyMiddleware(get_wsgi_application(), store=store, policy=policy)


if __name__ == "__main__":
    main("wsgi", create_app, __doc__.splitlines()[0])
