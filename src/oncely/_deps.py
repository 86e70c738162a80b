"""Optional dependencies, imported only when the feature that needs them is used."""

from __future__ import annotations

import importlib
from types import ModuleType

from oncely.errors import MissingDependencyError

__all__ = ["require"]


def require(module: str, *, extra: str) -> ModuleType:
    """Import an optional driver, or explain exactly which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{module!r} is required here; install it with: pip install 'oncely[{extra}]'"
        ) from exc
