"""Exceptions raised by oncely.

Every exception oncely raises on purpose derives from `OncelyError`, grouped by who must react::

    * OncelyError
      * ConfigurationError          also ValueError: bad setup, raised when a decorator,
                                    guard, policy or store is built
      * MissingDependencyError      also ImportError: names the extra to install
      * InvalidKeyError             also ValueError: empty, too long or not header-safe
      * FingerprintError            also TypeError: an argument cannot be fingerprinted
      * ConflictError               the repeat cannot run now; the caller chooses what to do
        * InProgressError           .key, .retry_after: another worker holds the lease
        * FingerprintMismatchError  .key: the same key was used for another operation
        * VersionConflictError      .key, .expected, .actual: a versioned row moved on
      * LeaseLostError              .key, .token: the lease expired and was taken over
      * ResultUnavailableError      .key: the operation ran, but its result cannot be replayed
      * StoreError                  .backend
        * StoreUnavailableError     transient: retry later (HTTP 503)
        * CorruptRecordError        .key: a foreign or undecodable record; fail closed
        * SchemaMissingError        the store's schema is absent or too old: run migrate()

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from datetime import timedelta

__all__ = [
    "ConfigurationError",
    "ConflictError",
    "CorruptRecordError",
    "FingerprintError",
    "FingerprintMismatchError",
    "InProgressError",
    "InvalidKeyError",
    "LeaseLostError",
    "MissingDependencyError",
    "OncelyError",
    "ResultUnavailableError",
    "SchemaMissingError",
    "StoreError",
    "StoreUnavailableError",
    "VersionConflictError",
]


class OncelyError(Exception):
    """Base class of every exception oncely raises on purpose."""


class ConfigurationError(OncelyError, ValueError):
    """oncely was set up wrongly: a bad option, URL or argument specification."""


class MissingDependencyError(OncelyError, ImportError):
    """An optional driver is not installed; the message names the extra that provides it."""


class InvalidKeyError(OncelyError, ValueError):
    """An idempotency key is empty, longer than 255 characters or not a header-safe string.

    Raised before the key touches a store.
    """


class FingerprintError(OncelyError, TypeError):
    """A value cannot be turned into a stable fingerprint or content hash."""


class ConflictError(OncelyError):
    """A repeat of an operation cannot run now.

    Attributes:
        key: The scoped key of the operation.
    """

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class InProgressError(ConflictError):
    """Another worker holds the lease for this key; try again after `retry_after`.

    Attributes:
        key: The scoped key of the operation.
        retry_after: How long the current lease has left.
    """

    def __init__(self, key: str, *, retry_after: timedelta) -> None:
        super().__init__(
            f"operation {key!r} is already in progress; retry after "
            f"{retry_after.total_seconds():.3f}s",
            key=key,
        )
        self.retry_after = retry_after


class FingerprintMismatchError(ConflictError):
    """The key was used before for an operation with other arguments: a client bug, not a retry."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"key {key!r} was already used for an operation with different arguments", key=key
        )


class VersionConflictError(ConflictError):
    """A versioned row was not at the version the change was decided on (optimistic locking):
    the expected one, or, after the retries ran out, the one last read.

    Attributes:
        key: The table and the row's id, as ``table:id``.
        expected: The version the change was made for.
        actual: The version the row has (``None``: there is no such row).
    """

    def __init__(self, key: str, *, expected: int, actual: int | None) -> None:
        now = "there is no such row" if actual is None else f"it is at version {actual}"
        super().__init__(f"{key!r} is not at version {expected}: {now}", key=key)
        self.expected = expected
        self.actual = actual


class LeaseLostError(OncelyError):
    """This worker's lease expired and another worker took the key over.

    The work done under the lost lease may be repeated by the new owner; fence downstream writes
    with `token` to reject the stale one.

    Attributes:
        key: The scoped key of the operation.
        token: The fencing token this worker held.
    """

    def __init__(self, key: str, *, token: int) -> None:
        super().__init__(f"lease on {key!r} with token {token} was lost to another worker")
        self.key = key
        self.token = token


class ResultUnavailableError(OncelyError):
    """The operation ran to completion, but its result was not stored in a replayable form.

    It is never executed again: the key stays completed until its record expires.

    Attributes:
        key: The scoped key of the operation.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"the result of {key!r} cannot be replayed: {reason}")
        self.key = key
        self.reason = reason


class StoreError(OncelyError):
    """The store failed an operation.

    Attributes:
        backend: The store backend's name, such as ``"sqlite"``.
    """

    def __init__(self, message: str, *, backend: str) -> None:
        super().__init__(message)
        self.backend = backend


class StoreUnavailableError(StoreError):
    """The store could not be reached or timed out; the outcome of the call is unknown."""


class CorruptRecordError(StoreError):
    """A record could not be decoded: written by something else, or damaged.

    oncely fails closed on it and never executes the operation again because of it.

    Attributes:
        key: The scoped key whose record is corrupt.
    """

    def __init__(self, message: str, *, backend: str, key: str) -> None:
        super().__init__(f"corrupt record for {key!r}: {message}", backend=backend)
        self.key = key


class SchemaMissingError(StoreError):
    """The store's schema is missing or older than this version of oncely: run ``migrate()``."""
