"""oncely: make any operation safe to retry.

Networks time out, clients retry and brokers redeliver; oncely turns "delivered at least once"
into "takes effect once". The top level exports the core nouns; integrations live in their own
modules (``oncely.http``, ``oncely.consumers``) so importing oncely loads no optional driver.

.. code-block:: python

    import oncely

    store = oncely.open_store("sqlite:///oncely.db")

    @oncely.idempotent(store=store, key="payment_id")
    def charge(payment_id: str, amount_cents: int) -> dict[str, str]:
        ...
"""

from __future__ import annotations as _annotations

import typing as _typing

from oncely._core.clock import Clock, SystemClock
from oncely._core.codec import Codec, JSONCodec
from oncely._core.policy import Policy
from oncely._core.protocols import AsyncStore, BatchStore, CheckableStore, Store, SyncStore
from oncely._core.records import (
    Acquired,
    ClaimResult,
    InProgress,
    LeaseLost,
    Mismatch,
    Record,
    Replay,
    Status,
    StoreHealth,
)
from oncely._execution import CurrentLease, current_lease
from oncely.decorator import IdempotentFunction, idempotent
from oncely.errors import (
    ConfigurationError,
    ConflictError,
    CorruptRecordError,
    FingerprintError,
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
    LeaseLostError,
    MissingDependencyError,
    OncelyError,
    ResultUnavailableError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
    VersionConflictError,
)
from oncely.guard import Guard
from oncely.inbox import Inbox, current_transaction
from oncely.outbox import Outbox
from oncely.stores import open_store

__all__ = [
    "Acquired",
    "AsyncStore",
    "BatchStore",
    "CheckableStore",
    "ClaimResult",
    "Clock",
    "Codec",
    "ConfigurationError",
    "ConflictError",
    "CorruptRecordError",
    "current_lease",
    "current_transaction",
    "CurrentLease",
    "FingerprintError",
    "FingerprintMismatchError",
    "Guard",
    "idempotent",
    "IdempotentFunction",
    "Inbox",
    "InProgress",
    "InProgressError",
    "InvalidKeyError",
    "JSONCodec",
    "LeaseLost",
    "LeaseLostError",
    "Mismatch",
    "MissingDependencyError",
    "OncelyError",
    "open_store",
    "Outbox",
    "Policy",
    "Record",
    "Replay",
    "ResultUnavailableError",
    "SchemaMissingError",
    "Status",
    "Store",
    "StoreError",
    "StoreHealth",
    "StoreUnavailableError",
    "SyncStore",
    "SystemClock",
    "VersionConflictError",
]


def __getattr__(name: str) -> _typing.Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("oncely")
    raise AttributeError(f"module 'oncely' has no attribute {name!r}")
