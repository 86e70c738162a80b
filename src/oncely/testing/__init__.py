"""Helpers for testing code that uses oncely, and the store conformance suite.

* `override_store`: route decorated functions to a test store (a fresh ``memory://`` one) inside
  a ``with`` block; the pytest fixture ``oncely_store`` does it for one test.
* `disabled`: turn oncely off inside a block, at every entry point (each call logs a warning).
* `FrozenClock`: a clock that moves only when told, for deterministic expiry tests.
* `StoreConformance`: the one test suite every store must pass (docs/contract.md), from
  `oncely.testing.conformance`. Subclass it in a pytest module and implement `open_store`; it
  needs pytest and hypothesis (``pip install 'oncely[testing]'``).

.. code-block:: python

    from oncely.testing.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        def open_store(self, clock):
            return MyStore(..., clock=clock)

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from oncely import _switches
from oncely._core.clock import FrozenClock
from oncely.errors import ConfigurationError

__all__ = ["FrozenClock", "StoreConformance", "disabled", "override_store"]

S = TypeVar("S")

if TYPE_CHECKING:
    from oncely.testing.conformance import StoreConformance


@contextlib.contextmanager
def override_store(store: S, *functions: Callable[..., Any]) -> Iterator[S]:
    """Inside the block, *functions* (decorated with `oncely.idempotent`) use *store*; with no
    functions given, every decorated function does.

    .. code-block:: python

        with oncely.testing.override_store(oncely.open_store("memory://")) as store:
            charge("o-1", 500)
            assert store.get("billing.charge|o-1") is not None

    Raises:
        ConfigurationError: A function given is not decorated with `oncely.idempotent`.

    .. versionadded:: 0.1.0
    """
    plans = []
    for function in functions:
        plan = getattr(function, "_oncely_plan", None)
        if plan is None:
            raise ConfigurationError(f"{function!r} is not decorated with oncely.idempotent")
        plans.append(plan)
    saved = [plan.store for plan in plans]
    previous = _switches.store
    if plans:
        for plan in plans:
            plan.store = store
    else:
        _switches.store = store
    try:
        yield store
    finally:
        for plan, original in zip(plans, saved, strict=True):
            plan.store = original
        _switches.store = previous


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block, every entry point runs its operation unprotected: decorated
    functions, `oncely.Guard`, the inbox, the HTTP middlewares and client transport, and the
    consumers. No store is called; every call is logged. (The outbox stays on.)

    The same switch as the ``ONCELY_DISABLED=1`` environment variable, which turns protection
    off for a whole process in an emergency (each call then logs a WARNING naming it).

    .. versionadded:: 0.1.0
    """
    previous, _switches.disabled = _switches.disabled, True
    try:
        yield
    finally:
        _switches.disabled = previous


def __getattr__(name: str) -> Any:
    if name == "StoreConformance":
        from oncely.testing.conformance import StoreConformance

        return StoreConformance
    raise AttributeError(f"module 'oncely.testing' has no attribute {name!r}")
