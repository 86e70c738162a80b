"""The public surface: curated, sorted, typed, and free of optional imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import oncely
import oncely.errors
import oncely.keys

SUBMODULES = {
    "aggregates",
    "bloom",
    "dashboard",
    "cli",
    "consumers",
    "decorator",
    "demo",
    "http",
    "errors",
    "guard",
    "inbox",
    "keys",
    "observe",
    "outbox",
    "pytest_plugin",
    "stores",
    "testing",
}


def test_public_names_are_exported_and_sorted() -> None:
    """Everything public in `oncely` is in `__all__`, and `__all__` is sorted."""
    public = {name for name in vars(oncely) if not name.startswith("_")} - SUBMODULES
    assert set(oncely.__all__) == public
    assert oncely.__all__ == sorted(oncely.__all__, key=str.casefold)


def test_every_error_is_exported_and_rooted() -> None:
    """Every exception in oncely.errors derives from OncelyError and is exported at the top."""
    for name in oncely.errors.__all__:
        error = getattr(oncely.errors, name)
        assert issubclass(error, oncely.OncelyError)
        assert getattr(oncely, name) is error


def test_errors_subclass_natural_builtins() -> None:
    """Generic handlers keep working: ValueError for bad input, ImportError for extras."""
    assert issubclass(oncely.InvalidKeyError, ValueError)
    assert issubclass(oncely.ConfigurationError, ValueError)
    assert issubclass(oncely.MissingDependencyError, ImportError)
    assert issubclass(oncely.InProgressError, oncely.ConflictError)
    assert issubclass(oncely.StoreUnavailableError, oncely.StoreError)


def test_import_loads_no_driver() -> None:
    """`import oncely` and opening the default store import no optional driver."""
    code = (
        "import sys, oncely; oncely.open_store('memory://'); "
        "bad = [m for m in ('redis', 'psycopg', 'click', 'httpx', 'pydantic', 'sqlite3', "
        "'hypothesis', 'pytest', 'prometheus_client', 'opentelemetry') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_is_resolved_lazily() -> None:
    """`oncely.__version__` comes from the installed metadata."""
    assert oncely.__version__ == "0.1.0"


def test_missing_driver_names_the_extra() -> None:
    """A missing optional driver raises MissingDependencyError naming the extra."""
    from oncely._deps import require

    with pytest.raises(oncely.MissingDependencyError, match=r"pip install 'oncely\[redis\]'"):
        require("oncely_no_such_driver", extra="redis")
