"""Transactional outbox: events written in the caller's transaction, published by a relay.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from oncely.outbox._event import NOT_ATTEMPTED, NotAttempted, OutboxEvent, Outcome, Publisher

__all__ = ["NOT_ATTEMPTED", "NotAttempted", "OutboxEvent", "Outcome", "Publisher"]
