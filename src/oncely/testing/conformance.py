"""The store conformance suite: every row of the state machine (docs/contract.md), run against
a real store. Public, for third-party stores: subclass `StoreConformance` in a pytest module.

Every test runs twice, through the sync verbs and through the async verbs. Stores that take an
injected clock (memory, SQLite) are driven by a `FrozenClock`; stores judged by a server's clock
use short leases and wait for them to pass.

.. code-block:: python

    from oncely.testing.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        def open_store(self, clock, namespace):
            return MyStore(namespace=namespace, clock=clock)

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from oncely.errors import MissingDependencyError

try:
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401
except ImportError as exc:
    raise MissingDependencyError(
        "StoreConformance needs pytest and hypothesis; install them with: "
        "pip install 'oncely[testing]'"
    ) from exc

from oncely.testing._batches import BatchChecks
from oncely.testing._calls import StoreCalls, claim_in_process
from oncely.testing._claims import ClaimChecks
from oncely.testing._leases import LeaseChecks
from oncely.testing._model import ModelChecks
from oncely.testing._probes import ProbeChecks
from oncely.testing._races import RaceChecks

__all__ = ["StoreCalls", "StoreConformance", "claim_in_process"]


class StoreConformance(ClaimChecks, ProbeChecks, BatchChecks, RaceChecks, ModelChecks, LeaseChecks):
    """Subclass in a pytest module and implement `open_store` (and `store_url` for processes).

    Attributes:
        controls_clock: The store judges time by the ``clock`` passed to `open_store`; when
            False it uses a server clock, and the suite waits for short leases to pass.
        lease: The lease used by tests that let it expire.
        racers: How many concurrent claimers the races use.
        preload: Modules the process race's forkserver imports once, so that 64 children do
            not each import the driver (effective when this class starts the forkserver).

        batch_verbs: The store has the optional `oncely.BatchStore` verbs, and the
            ``test_batch_*`` tests hold it to them (a store without them sets False: those
            tests then check that it does not pretend to have them).
        batch_call_ids: The store's ``claim_many`` takes the claims' call ids (``ops=``) and
            answers a batch sent again with them as the first send (every built-in store does;
            `CoalescingStore` relies on it after a lost reply). False: the test checks that
            it does not pretend to.
        check_verbs: The store has the optional `oncely.CheckableStore` probe, held to it by
            the ``test_check_*`` tests (False: they check that it does not pretend to).
        forget_verb: The store has the optional ``forget``/``aforget`` (every built-in store
            does; ``oncely forget`` needs it), held to it by the ``test_forget_*`` tests.

    A store that cannot be shared between processes (the memory store) sets
    ``test_claim_race_processes_exactly_one_acquires = None`` in its subclass.
    """
