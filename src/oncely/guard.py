"""`Guard`: explicit idempotency around any block, sync (``with``) or async (``async with``).

.. code-block:: python

    with Guard(store, f"refund:{refund_id}", fingerprint=(refund_id, amount)) as guard:
        if guard.replayed:
            return guard.result          # the stored outcome of an earlier run
        receipt = bank.refund(refund_id, amount, fencing_token=guard.token)
        guard.complete(receipt)

Entering claims the key (raising `InProgressError` or `FingerprintMismatchError` as the policy
says) and starts a heartbeat that keeps the lease alive while the block runs. Leaving the block
normally completes it (with ``None`` when `complete` was not called: a block that ran is never
released); leaving by an exception releases the lease, or stores the exception when its type is
declared final.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import gc
import sys
import types
import uuid
from types import TracebackType
from typing import Any, Literal

from oncely import _events, _execution, _observed, _switches
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import digest
from oncely._core.flow import Flow
from oncely._core.keys import code_scope, name_key, scope_key, validate_key
from oncely._core.policy import UNSET, Duration, Policy, _Unset, derive
from oncely._core.protocols import AsyncStore, SyncStore
from oncely._core.records import Replay
from oncely.errors import ConfigurationError, OncelyError

__all__ = ["Guard"]


class Guard:
    """Claim a key around a block of code, then complete, fail or release it.

    Args:
        store: The store that keeps the record (any `oncely.SyncStore` for ``with``, any
            `oncely.AsyncStore` for ``async with``).
        key: The idempotency key (a string, an int or a `uuid.UUID`); validated
            (`InvalidKeyError`) before it touches the store.
        fingerprint: What the block was asked to do (any canonicalisable value); the same key with
            another fingerprint raises `FingerprintMismatchError`. A guard has no arguments of
            its own to fingerprint, so the default ``None`` checks nothing: pass the request's
            content (``fingerprint=(refund_id, amount)``) to catch a key reused for other work.
        scope: A namespace for the key (for example the operation's name). Default: the code
            that creates the guard, as ``<module>.<qualified name>`` of the calling function
            (``<module>.<module>`` at module level), named as an ``import`` names it however the
            program was started, so guards in two functions never share a key. Pass a fixed
            scope when the code may move or be renamed while keys are still live, or when
            several call sites must name one operation. (Earlier releases used
            ``"guard"`` for every guard: pass it to keep finding the records they wrote.)
        policy: The base `Policy`; the keyword arguments below override single fields of it.
        ttl: How long the outcome is replayed (timedelta or seconds).
        lease: How long the lease lasts between heartbeats.
        on_conflict: ``"raise"`` or ``"wait"`` for a concurrent duplicate.
        final_errors: Exception types stored and replayed instead of releasing the lease.
        heartbeat: Keep the lease alive while the block runs (default on).
        codec: Serialises the value given to `complete` (JSON by default).

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: SyncStore | AsyncStore,
        key: str | int | uuid.UUID,
        *,
        fingerprint: Any = None,
        scope: str | None = None,
        policy: Policy | None = None,
        ttl: Duration | _Unset = UNSET,
        lease: Duration | _Unset = UNSET,
        on_conflict: Literal["raise", "wait"] | _Unset = UNSET,
        final_errors: tuple[type[BaseException], ...] | _Unset = UNSET,
        heartbeat: bool | _Unset = UNSET,
        codec: Codec | None = None,
    ) -> None:
        self.store = store
        scope = scope if scope is not None else _caller_scope()
        self.key = scope_key(scope, validate_key(name_key(key)))
        self.fingerprint = "" if fingerprint is None else digest([fingerprint])
        self.policy = derive(
            policy,
            ttl=ttl,
            lease=lease,
            on_conflict=on_conflict,
            final_errors=final_errors,
            heartbeat=heartbeat,
        )
        self.codec: Codec = codec or JSONCodec()
        self._lease: _execution.Lease | None = None
        self._replay: Replay | None = None
        self._settled = False
        self._off = False

    # -- state ---------------------------------------------------------------------------------

    @property
    def replayed(self) -> bool:
        """True when the operation had already finished: use `result`, do not run it again."""
        return self._replay is not None

    @property
    def result(self) -> Any:
        """The replayed outcome: the stored value, or the stored final error raised again.

        Raises:
            ResultUnavailableError: The outcome ran but could not be stored in replayable form.
            OncelyError: The guard did not replay (check `replayed` first).
        """
        if self._replay is None:
            raise OncelyError("this guard holds the lease: there is no stored result to replay")
        return _execution.replay(self._replay, self.codec, Any, self.policy)

    @property
    def token(self) -> int:
        """The fencing token of the lease: pass it to downstream writes to reject stale workers."""
        return self._held().token

    @property
    def recovered(self) -> bool:
        """True when the lease was taken over from a worker whose lease had expired."""
        return self._held().recovered

    @property
    def attempt(self) -> int:
        """How many times this operation has been started, this run included."""
        return self._held().attempt

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat or settle call found the lease taken over."""
        return self._lease is not None and self._lease.lost

    def _held(self) -> _execution.Lease:
        if self._lease is None:
            raise OncelyError("this guard does not hold a lease (not entered, or replayed)")
        return self._lease

    def _settle_flow(self, verb: str, value: Any = None) -> Flow[None]:
        lease = self._held()
        if self._settled:
            raise OncelyError(f"the guard for {self.key!r} was already settled")
        self._settled = True
        if self._off:
            return _nothing()
        if verb == "complete":
            return _execution.complete_or_raise(lease, value, self.codec, self.policy)
        if verb == "fail":
            return _execution.settle_error(lease, value, self.policy)
        return _execution.settle(lease, "release", None, self.policy)

    def _exit_flow(self, exc: BaseException | None) -> Flow[None]:
        if self._lease is None or self._settled or self._off:
            return _nothing()
        if exc is None:
            return self._settle_flow("complete", None)
        self._settled = True
        return _execution.settle_error(self._lease, exc, self.policy)

    def _unprotected(self) -> bool:
        """Under ``ONCELY_DISABLED`` (or `oncely.testing.disabled`): the block runs with a
        lease of token 0 that is never written, the store is not touched, a warning says so."""
        if not _switches.disabled:
            return False
        _switches.warn_unprotected(self.key, key=self.key)
        self._off = True
        self._lease = _execution.Lease(self.key, 0, self.policy.lease)
        return True

    def _entered(self, outcome: _execution.Lease | Replay) -> Guard:
        if isinstance(outcome, Replay):
            self._replay = outcome
        else:
            self._lease = outcome
        return self

    # -- sync ----------------------------------------------------------------------------------

    def __enter__(self) -> Guard:
        if self._unprotected():
            return self
        store = _require(self.store, SyncStore, "with")
        flow = _execution.acquire(self.key, self.fingerprint, self.policy)
        if _events.on:
            flow = _observed.entering(self, flow, "function", self.key, store)
        return self._entered(_execution.run(flow, store))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if _events.on:
            _observed.exited(self, exc)
        _execution.run(self._exit_flow(exc), _require(self.store, SyncStore, "with"))

    def complete(self, value: Any = None) -> None:
        """Store *value* as the outcome now (it is replayed to later duplicates).

        Raises:
            LeaseLostError: The lease was taken over; another worker may repeat the work.
        """
        store = _require(self.store, SyncStore, "with")
        _execution.run(self._settle_flow("complete", value), store)

    def fail(self, error: BaseException) -> None:
        """Settle with *error*: stored if its type is final, else the lease is released."""
        store = _require(self.store, SyncStore, "with")
        _execution.run(self._settle_flow("fail", error), store)

    def release(self) -> None:
        """Give the lease up without an outcome, so the next claim executes."""
        store = _require(self.store, SyncStore, "with")
        _execution.run(self._settle_flow("release"), store)

    # -- async ---------------------------------------------------------------------------------

    async def __aenter__(self) -> Guard:
        if self._unprotected():
            return self
        store = _require(self.store, AsyncStore, "async with")
        flow = _execution.acquire(self.key, self.fingerprint, self.policy)
        if _events.on:
            flow = _observed.entering(self, flow, "function", self.key, store)
        return self._entered(await _execution.arun(flow, store))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        store = _require(self.store, AsyncStore, "async with")
        if _events.on:
            _observed.exited(self, exc)
        await _execution.arun(self._exit_flow(exc), store)

    async def acomplete(self, value: Any = None) -> None:
        """Async `complete`."""
        store = _require(self.store, AsyncStore, "async with")
        await _execution.arun(self._settle_flow("complete", value), store)

    async def afail(self, error: BaseException) -> None:
        """Async `fail`."""
        store = _require(self.store, AsyncStore, "async with")
        await _execution.arun(self._settle_flow("fail", error), store)

    async def arelease(self) -> None:
        """Async `release`."""
        store = _require(self.store, AsyncStore, "async with")
        await _execution.arun(self._settle_flow("release"), store)


def _caller_scope() -> str:
    """The scope of the code that creates a guard: its module and qualified name."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back  # Guard.__init__ itself, and any subclass defined here
    if frame is None:  # pragma: no cover - a guard is always created by some code
        return "guard"
    return code_scope(str(frame.f_globals.get("__name__", "__main__")), _qualname(frame.f_code))


def _qualname(code: types.CodeType) -> str:
    qualname = getattr(code, "co_qualname", None)  # Python 3.11+
    if isinstance(qualname, str):
        return qualname
    # Python 3.10: the function object that runs this code knows its qualified name.
    for referrer in gc.get_referrers(code):
        if isinstance(referrer, types.FunctionType) and referrer.__code__ is code:
            return referrer.__qualname__
    return code.co_name


def _nothing() -> Flow[None]:
    return
    yield


def _require(store: Any, kind: type[Any], how: str) -> Any:
    if not isinstance(store, kind):
        raise ConfigurationError(f"{type(store).__name__} cannot be used with `{how}`")
    return store
