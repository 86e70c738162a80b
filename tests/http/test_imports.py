"""`oncely.http` is importable without any web framework, and its public names are curated."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

FRAMEWORKS = [
    "starlette", "fastapi", "flask", "werkzeug", "django", "litestar", "uvicorn", "waitress",
    "httpx", "anyio",
]  # fmt: skip


def test_importing_the_middleware_imports_no_framework() -> None:
    """``import oncely.http.asgi`` / ``.wsgi`` / ``.django`` load no framework, server or HTTP
    client (the Django middleware imports Django when Django builds it)."""
    code = (
        "import sys, oncely.http, oncely.http.asgi, oncely.http.wsgi, oncely.http.django\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module",
    [
        "oncely.http",
        "oncely.http.asgi",
        "oncely.http.wsgi",
        "oncely.http.django",
        "oncely.http.client",
    ],
)
def test_public_names_are_exported_and_sorted(module: str) -> None:
    """Every public module declares a sorted ``__all__`` naming what exists."""
    imported = importlib.import_module(module)
    assert imported.__all__ == sorted(imported.__all__, key=str.casefold)
    for name in imported.__all__:
        assert hasattr(imported, name), name


def test_the_package_exports_the_shared_nouns() -> None:
    import oncely.http

    assert set(oncely.http.__all__) >= {
        "HttpPolicy",
        "HttpRequest",
        "RouteOptions",
        "idempotent_route",
        "default_scope",
        "default_fingerprint",
    }
