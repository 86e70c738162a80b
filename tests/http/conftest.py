"""Fixtures of the HTTP suite: every adapter x every store.

Adapters are the example apps under ``examples/http`` (bare ASGI, bare WSGI, FastAPI,
Starlette, Flask, Django under WSGI and ASGI, and oncely's Django middleware in a sync stack
and in an async one with async views); stores are memory, SQLite, PostgreSQL and Redis, each
opened once per session with a unique namespace (server URLs from the environment: a
missing one fails, it is never skipped; deselect with ``-m "not postgres and not redis"``).
Async apps all run on one event loop in a background thread, which the stores' per-loop
clients stay bound to.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

import oncely
from oncely import Store
from oncely.http import HttpPolicy
from tests.conftest import service_url
from tests.http._harness import Api, FaultyStore

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "http"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]

ADAPTERS = [
    pytest.param("asgi_app", id="asgi"),
    pytest.param("wsgi_app", id="wsgi"),
    pytest.param("fastapi_app", id="fastapi"),
    pytest.param("starlette_app", id="starlette"),
    pytest.param("flask_app", id="flask"),
    pytest.param("django_app", id="django"),
    pytest.param("django_asgi_app", id="django-asgi"),
    pytest.param("django_middleware_app", id="django-middleware"),
    pytest.param("django_async_app", id="django-async"),
]

ASGI = {"asgi_app", "fastapi_app", "starlette_app", "django_asgi_app", "django_async_app"}

STORE_SAMPLERS = {"asgi_app", "wsgi_app"}
"""The adapters that run a `store_independent` test against every store (async and sync paths);
the others run it against the memory store only."""

LEASE = 0.6
"""The suite's lease in seconds: short, so a lost lease shows within a test."""

MAX_RESPONSE = 64 * 1024
"""The suite's response size limit."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "store_independent: a test of the adapter's timing that no store changes: every adapter "
        "on the memory store, every store on the bare ASGI and WSGI adapters (the full cross "
        "product costs seconds per combination and adds no coverage)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Thin the adapter x store matrix of `store_independent` tests (see the marker)."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("store_independent") and callspec is not None:
            adapter = callspec.params.get("adapter")
            backend = callspec.params.get("backend_store")
            if backend not in (None, "memory") and adapter not in STORE_SAMPLERS:
                dropped.append(item)
                continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL store URL with a schema of this session's own: migrated, then dropped."""
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_http_{uuid.uuid4().hex[:10]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with oncely.open_store(url) as store:
        store.migrate()  # type: ignore[attr-defined]
    yield url
    import psycopg

    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def store_url(request: pytest.FixtureRequest, backend: str, directory: Path) -> str:
    """The URL of a test store of *backend* (a missing server fails the test)."""
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return f"sqlite:///{directory}/oncely.db"
    if backend == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    return service_url("ONCELY_TEST_REDIS_URL")


@pytest.fixture(scope="session")
def portal() -> Iterator[BlockingPortal]:
    """One event loop, in a thread, for every async app of the session."""
    with start_blocking_portal(backend="asyncio") as running:
        yield running


@pytest.fixture(scope="session", params=STORES)
def backend_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, portal: BlockingPortal
) -> Iterator[Store]:
    """One store per backend for the session, in a namespace of its own."""
    url = store_url(request, request.param, tmp_path_factory.mktemp(f"http-{request.param}"))
    store = oncely.open_store(url, namespace=f"http-{uuid.uuid4().hex[:12]}")
    try:
        yield store
    finally:
        portal.call(store.aclose)  # the loop's async clients, before the sync close
        store.close()


@pytest.fixture
def store(backend_store: Store) -> FaultyStore:
    """The session's store, wrapped so that a test can make verbs fail."""
    return FaultyStore(backend_store)


@pytest.fixture(params=ADAPTERS)
def adapter(request: pytest.FixtureRequest) -> str:
    """The example module under test."""
    return str(request.param)


@pytest.fixture
def make_api(
    adapter: str, store: FaultyStore, portal: BlockingPortal, tmp_path: Path
) -> Callable[..., Api]:
    """Build the adapter's app around *store*, with the suite's policy unless one is given."""
    module = importlib.import_module(adapter)
    ledger_module = importlib.import_module("_payments")

    def make(policy: HttpPolicy | None = None) -> Api:
        policy = policy or HttpPolicy(lease=LEASE, max_response_bytes=MAX_RESPONSE)
        ledger = ledger_module.Ledger(tmp_path / f"payments-{uuid.uuid4().hex[:8]}.db")
        app = module.create_app(store, ledger, policy)
        kind = "asgi" if adapter in ASGI else "wsgi"
        return Api(app, kind, portal, ledger, store)

    return make


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    """The adapter's app with the suite's policy."""
    return make_api()


@pytest.fixture
def key() -> str:
    """A fresh idempotency key (the session's store is shared between tests)."""
    return f"key-{uuid.uuid4()}"
