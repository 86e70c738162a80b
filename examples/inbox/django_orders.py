"""A Django view that writes an order and its idempotency record in one PostgreSQL transaction.

Run it (one file, no ORM models; needs django and psycopg)::

    DATABASE_URL=postgresql://localhost/shop python examples/inbox/django_orders.py runserver
    curl -i -X POST localhost:8000/orders -H 'Idempotency-Key: 42' \\
         -H 'Content-Type: application/json' -d '{"item": "book", "cents": 1200}'

Inside ``transaction.atomic()`` the view claims the key on Django's own connection, writes the
order and completes the record: they commit together or not at all. A repeat of a committed
request replays its response (``Idempotent-Replayed: true``); a request whose transaction rolled
back, or whose process died before the commit, left nothing, so its retry runs afresh.

``X-Simulate: fail`` makes the view raise after writing the order (``atomic`` rolls back);
``X-Simulate: crash`` kills the process there, as a SIGKILL would.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from urllib.parse import parse_qs, urlsplit

import django
from django.conf import settings
from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

import oncely

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS orders (
    id text PRIMARY KEY, item text NOT NULL, cents integer NOT NULL, created_at timestamptz
)
"""


def database_settings(url: str) -> dict[str, object]:
    """Django's DATABASES entry for a ``postgresql://user@host:port/name?options=...`` URL."""
    parts = urlsplit(url)
    options = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": parts.port or "",
        "OPTIONS": options,
    }


if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["*"],
        DATABASES={"default": database_settings(os.environ["DATABASE_URL"])},
        INSTALLED_APPS=[],
        LOGGING_CONFIG=None,
    )
    django.setup()

store = oncely.open_store(os.environ.get("ONCELY_STORE_URL") or os.environ["DATABASE_URL"])
inbox = oncely.Inbox(store)


def setup() -> None:
    """Create oncely's table and the orders table (a migration, in a real project)."""
    store.migrate()  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute(SCHEMA_SQL)


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    key = request.headers.get("Idempotency-Key", "")
    order = json.loads(request.body)
    try:
        with (
            transaction.atomic(),
            inbox.claim(connection, key, scope="orders.create", fingerprint=order) as entry,
        ):
            if entry.replayed:
                return JsonResponse(
                    entry.result, status=201, headers={"Idempotent-Replayed": "true"}
                )
            order_id = f"ord_{uuid.uuid4().hex[:12]}"
            with connection.cursor() as cursor:
                cursor.execute(
                    "INSERT INTO orders VALUES (%s, %s, %s, now())",
                    [order_id, order["item"], order["cents"]],
                )
            if request.headers.get("X-Simulate") == "crash":
                os._exit(9)  # the transaction dies with the process: neither row commits
            if request.headers.get("X-Simulate") == "fail":
                raise RuntimeError("the view failed after writing the order")
            body = {"id": order_id, "item": order["item"], "cents": order["cents"]}
            entry.complete(body)
    except oncely.InvalidKeyError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    except oncely.FingerprintMismatchError:
        return JsonResponse({"error": "this key was used for another order"}, status=422)
    except oncely.InProgressError:
        return JsonResponse(
            {"error": "this order is being placed"}, status=409, headers={"Retry-After": "1"}
        )
    return JsonResponse(body, status=201)


urlpatterns = [path("orders", create_order)]

if __name__ == "__main__":
    from django.core.management import execute_from_command_line

    setup()
    execute_from_command_line(sys.argv)
