"""oncely's pytest plugin. Turn it on in your ``conftest.py``::

    pytest_plugins = ["oncely.pytest_plugin"]

(or with ``pytest -p oncely.pytest_plugin``). It is not registered automatically: pytest would
then rewrite the assertions of the whole oncely package in every project that installs it.

Fixtures:

* ``oncely_store``: a fresh ``memory://`` store that every function decorated with
  `oncely.idempotent` uses for the duration of the test, so tests never see each other's
  records nor touch a real store.

.. code-block:: python

    def test_charge_runs_once(oncely_store):
        charge("o-1", 500)
        charge("o-1", 500)
        assert bank.charges == 1

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from oncely.stores import open_store
from oncely.stores.memory import MemoryStore
from oncely.testing import override_store


@pytest.fixture
def oncely_store() -> Iterator[MemoryStore]:
    """A fresh in-memory store, used by every decorated function during the test."""
    store = open_store("memory://")
    assert isinstance(store, MemoryStore)
    with override_store(store):
        yield store
    store.close()
