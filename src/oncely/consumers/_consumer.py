"""The broker-agnostic consumer runner: the consumer contract (docs/guides/consumers.md) as
pure decisions.

A broker adapter turns each delivery into a `Delivery` (body, headers, the broker's message id),
asks `IdempotentConsumer` for a `Verdict`, and translates the verdict into the broker's verbs:

==========================================  =========================  =========================
situation                                   handler                    verdict
==========================================  =========================  =========================
new key                                     runs once                  ACK after ``complete``
completed duplicate                         skipped, logged, counted   ACK
copy of a dead-lettered message             not run                    DEAD_LETTER
duplicate whose lease is live elsewhere     not run now                RETRY after a delay
handler raised, attempts left               lease released             RETRY, broker's policy
handler raised on attempt N, or a declared  record failed (the         DEAD_LETTER
  dead-letter error                          decision, kept)
claimed on attempt N + 1 (workers killed    not run                    DEAD_LETTER
  mid-handler N times)
store unreachable, or the lease was lost    not run / not settled      RETRY after a delay
key missing or invalid, fingerprint         not run                    DEAD_LETTER
  mismatch, corrupt record
==========================================  =========================  =========================

``attempt`` is the record's own count of starts (`oncely.Record.attempt`): it survives releases,
lease takeovers and redelivery to another worker, so a message that kills every worker that
touches it is dead-lettered after N starts even on brokers that do not count deliveries.

The decisions are one sans-I/O flow (`IdempotentConsumer.flow`); `IdempotentConsumer.process`
and `IdempotentConsumer.aprocess` run it against a sync or an async store. Adapters that have a
loop of their own (Kafka, Redis Streams) write it as a flow too, yielding `BrokerOp` values that
`run_with` and `arun_with` hand to the adapter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from datetime import timedelta
from typing import Any

from oncely import _events, _execution, _observed, _switches
from oncely._core import codec as _codec
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import (
    digest,
)
from oncely._core.flow import Flow
from oncely._core.keys import name_key, scope_key, validate_key
from oncely._core.protocols import AsyncStore, BatchStore, SyncStore
from oncely._core.records import Acquired, InProgress, Mismatch, Replay
from oncely._log import fields, get_logger
from oncely.consumers._abatch import abatched
from oncely.consumers._batch import (
    batched,
    blocked_verdict,
    claim_many,
    settled_verdict,
)
from oncely.consumers._decision import decide, report, retry_delay
from oncely.consumers._drivers import Handle, _require, ano_broker, arun_with, no_broker, run_with
from oncely.consumers._grouping import acomplete, encoded
from oncely.consumers._keys import _body_fingerprint, _content_key, _header_key
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    ConsumerStats,
    Delivery,
    FingerprintSource,
    KeySource,
    Reason,
    Verdict,
)
from oncely.errors import (
    ConfigurationError,
    InvalidKeyError,
    LeaseLostError,
    OncelyError,
    StoreError,
)
from oncely.keys import from_header
from oncely.stores._coalescing import CoalescingStore

logger = get_logger(__name__)

BATCH_VERBS: tuple[str, ...] = ("claim_many", "complete_many", "aclaim_many", "acomplete_many")
"""The verbs of `oncely.BatchStore` (whose docstring is their contract), which
`IdempotentConsumer.batch_flow` uses when a store has all of them."""


class IdempotentConsumer:
    """Decide, for each delivery, whether the handler runs and what the broker is told.

    Adapters (`oncely.consumers.rabbitmq` and the others) build one per handler; use it
    directly to support a broker oncely has no adapter for.

    Args:
        store: Where the records are kept (a `SyncStore` for `process`, an `AsyncStore` for
            `aprocess`; built-in stores are both).
        scope: The namespace of the keys, normally the consumer group and handler: two
            consumer groups each process a message once.
        policy: Leases, retention, attempts (see `ConsumerPolicy`).
        key: Where each message's key comes from (see `KeySource`).
        key_headers: The headers tried for ``key="header"``, in order.
        fingerprint: What defines a message's operation; the same key with another fingerprint
            is dead-lettered as a producer bug.
        codec: Serialises what the handler returns, for the record.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        store: SyncStore | AsyncStore,
        *,
        scope: str,
        policy: ConsumerPolicy | None = None,
        key: KeySource = "header",
        key_headers: tuple[str, ...] = KEY_HEADERS,
        fingerprint: FingerprintSource = "body",
        codec: Codec | None = None,
    ) -> None:
        if not scope:
            raise ConfigurationError("a consumer needs a scope (its group or handler name)")
        if not (key in ("header", "content") or callable(key)):
            raise ConfigurationError(f"key must be 'header', 'content' or a callable, not {key!r}")
        if not (fingerprint in ("body", None) or callable(fingerprint)):
            raise ConfigurationError(
                f"fingerprint must be 'body', None or a callable, not {fingerprint!r}"
            )
        self.store = store
        self.scope = scope
        self.policy = policy if policy is not None else ConsumerPolicy()
        self.key = key
        self.key_headers = tuple(key_headers)
        self.fingerprint = fingerprint
        self.codec: Codec = codec or JSONCodec()
        self.stats = ConsumerStats()
        self._ran_ns: dict[str, tuple[int, int]] = {}  # a batch's handler runs, observed
        self._policy = self.policy.as_policy()
        self._async_calls: Any = None  # (loop, grouped store, running keys): see _grouped
        self._takes_ops: bool | None = None  # whether claim_many takes call ids, once known
        self._coalescing: CoalescingStore | None = None  # see _calls_to
        self._kinds: tuple[Any, dict[type[Any], bool]] = (None, {})  # see _is
        self._scoped = (scope, scope_key(scope, ""))  # scope_key(scope, k) is prefix + k

    # -- pieces ----------------------------------------------------------------------------

    def key_for(self, delivery: Delivery) -> str:
        """Return the scoped key of *delivery*.

        Raises:
            InvalidKeyError: The key is missing, empty, too long or not header-safe.
        """
        if self.key == "content":
            raw = _content_key(delivery)
        elif self.key == "header":
            try:
                raw = _header_key(delivery, self.key_headers)
            except KeyError as exc:
                raise InvalidKeyError(str(exc.args[0])) from None
        else:
            named = name_key(self.key(delivery))  # a UUID or an int names a message too
            raw = from_header(named) if isinstance(named, (str, bytes)) else validate_key(named)
        scoped = self._scoped
        if scoped[0] is not self.scope:  # the scope's stored prefix, once per scope
            scoped = self._scoped = (self.scope, scope_key(self.scope, ""))
        return scoped[1] + raw

    def fingerprint_for(self, delivery: Delivery) -> str:
        """Return the digest of what *delivery* asks for (empty when unchecked)."""
        if self.fingerprint is None or (self.key == "content" and self.fingerprint == "body"):
            return ""  # the key is the content already
        if self.fingerprint == "body":
            return _body_fingerprint(delivery.body)
        return digest([self.fingerprint(delivery)])

    def _verdict(self, verdict: Verdict) -> Verdict:
        self.stats.add(verdict.reason)
        if _events.on:
            _observed.verdict(self, verdict)
        return verdict

    def _retry_delay(self, limit: timedelta | None = None) -> timedelta:
        return retry_delay(self.policy, limit)

    # -- the decisions, once -----------------------------------------------------------------

    def flow(self, delivery: Delivery) -> Flow[Verdict]:
        """The decisions for *delivery*, as a sans-I/O flow (see `oncely._core.flow`).

        It yields the shared operations of `oncely._execution` (store calls, the handler's
        ``Invoke``, heartbeats) and returns the `Verdict`. It raises only what the handler
        raised that is not an `Exception` (cancellation, interpreter exit) and a
        `ConfigurationError` (the application's setup is wrong, not the message), after
        releasing the lease.
        """
        if _switches.disabled:
            return (yield from self._unprotected(delivery))
        try:
            key = self.key_for(delivery)
            fingerprint = self.fingerprint_for(delivery)
        except Exception as exc:
            return self._verdict(self._unusable(exc))
        return (yield from self._keyed_flow(key, fingerprint))

    def _keyed_flow(self, key: str, fingerprint: str) -> Flow[Verdict]:
        """`flow` from the claim on, for a delivery of *key* and *fingerprint*."""
        try:
            answer = yield _execution.StoreCall(
                "claim", (key, fingerprint), {"lease": self._policy.lease, "ttl": self._policy.ttl}
            )
        except StoreError as exc:
            answer = exc
        verdict, lease = self._claimed(key, answer)
        if verdict is not None:
            if lease is not None:  # exhausted: given back, not run
                yield from self._release(lease)
            return self._verdict(verdict)
        assert lease is not None
        if self._policy.heartbeat:
            yield _execution.StartHeartbeat(lease)
        try:
            value = yield _execution.Invoke(lease)
        except ConfigurationError:
            yield from self._release(lease)  # not the message's failure: never redelivered as one
            raise
        except Exception as exc:
            verdict = self._failed(key, lease.attempt, exc)
            yield from self._settle_failure(lease, verdict, exc)
            return self._verdict(verdict)
        except BaseException:
            yield from self._release(lease)
            raise
        try:
            yield from _execution.complete_with(lease, value, self.codec, self._policy)
        except LeaseLostError as exc:
            # Another worker took the message over; its copy decides. Acking ours is not safe
            # (the record is not completed); the redelivery will be a duplicate and be acked.
            return self._verdict(
                Verdict(Action.RETRY, Reason.LEASE_LOST, key, self._retry_delay(), error=exc)
            )
        except StoreError as exc:
            # The effect happened but is not recorded: not acked. Until the lease expires the
            # redelivery waits; after it, it runs again (closed only by a transactional inbox).
            return self._verdict(
                Verdict(Action.RETRY, Reason.STORE_UNAVAILABLE, key, self._retry_delay(), error=exc)
            )
        return self._verdict(
            Verdict(Action.ACK, Reason.PROCESSED, key, attempt=lease.attempt, result=value)
        )

    # -- batches: one claim round trip per fetched batch, completions grouped --------------------

    @property
    def batches(self) -> bool:
        """Whether the store is a `oncely.BatchStore`: then a batch is claimed in one call."""
        return self._is(BatchStore)

    def _is(self, kind: type[Any]) -> bool:
        """Whether the store is a *kind* (a store protocol), checked once per store: a
        protocol's isinstance looks each of its members up, tens of µs for every batch."""
        known = self._kinds
        if known[0] is not self.store:
            known = self._kinds = (self.store, {})
        answer = known[1].get(kind)
        if answer is None:
            answer = known[1][kind] = isinstance(self.store, kind)
        return answer

    def _required(self, kind: type[Any]) -> Any:
        """The store, a *kind* (see `_is`); else `ConfigurationError`."""
        return self.store if self._is(kind) else _require(self.store, kind)

    def batch_flow(
        self,
        deliveries: Sequence[Delivery],
        *,
        ordered: bool = False,
        held: MutableMapping[str, _execution.Lease] | None = None,
    ) -> Flow[list[Verdict]]:
        """The decisions for a fetched batch, as one flow; verdicts come back in order.

        With a store that has the batch verbs (`batches`), every key of the batch is claimed in
        one call; the handlers run concurrently (async) or one after the other (sync), each
        with the message of its `Delivery.raw` (via `Run`), while one heartbeat per lease keeps
        the batch's leases alive. Each outcome is completed as soon as its handler returns,
        while the next handlers run; those finishing while a completion is in flight go
        together as one batch call. Copies of one key within the batch are claimed once: they
        are duplicates of the first copy's outcome. Without the batch verbs each delivery runs
        through `flow` in turn.

        With *ordered* (Kafka partitions), nothing runs after a delivery that must be retried:
        the later ones come back as `Reason.BLOCKED` retries, so effects keep the batch's order.
        Their leases are kept in *held* (not released: a release would count as an attempt)
        and used again when the same keys come back in the next call with the same *held*,
        once an extend shows they are still ours (one taken over meanwhile is claimed again);
        give what is left back with `release_flow` when the deliveries are abandoned. *held*
        may be shared by the flows of several ordered sequences (a Kafka member's partitions):
        a copy of a key in another sequence then runs under the lease kept for it, rather
        than finding the key busy and blocking its own sequence too.

        Adapters drive it with `run_with` / `arun_with`, since it yields `Run` and `Handle`
        operations.
        """
        if not self.batches or _switches.disabled:  # one by one through `flow`
            verdicts: list[Verdict] = []
            for delivery in deliveries:
                if ordered and any(v.action is Action.RETRY for v in verdicts):
                    verdicts.append(self._verdict(blocked_verdict(self, None)))
                    continue
                verdicts.append((yield Handle(delivery.raw, self.flow(delivery))))
            return verdicts
        return (yield from batched(self, deliveries, ordered, {} if held is None else held))

    def _unprotected(self, delivery: Delivery) -> Flow[Verdict]:
        """Under ``ONCELY_DISABLED`` (or `oncely.testing.disabled`): the handler runs, under a
        lease of token 0 that is never written, the store is not touched, a warning says so;
        a failure is retried (or dead-lettered, for ``dead_letter_on``) with no attempt count."""
        try:
            key: str | None = self.key_for(delivery)
        except Exception:  # no key: it would be dead-lettered, but nothing is checked now
            key = None
        _switches.warn_unprotected(key or self.scope, key=key, scope=self.scope)
        lease = _execution.Lease(key or self.scope, 0, self.policy.lease)
        try:
            value = yield _execution.Invoke(lease)
        except ConfigurationError:
            raise
        except Exception as exc:
            return self._verdict(self._failed(lease.key, 1, exc))
        return self._verdict(Verdict(Action.ACK, Reason.PROCESSED, key, result=value))

    def release_flow(self, held: dict[str, _execution.Lease]) -> Flow[None]:
        """Release the leases `batch_flow` kept in *held* (the deliveries were abandoned)."""
        while held:
            yield from self._release(held.popitem()[1])

    def _claimed(self, key: str, answer: object) -> tuple[Verdict | None, _execution.Lease | None]:
        """Decide on one claim answer (`decide`): a verdict, or the lease to run the handler
        under; both when that lease must be given back unused (exhausted)."""
        verdict = decide(key, answer, self.policy, self._replayed)
        lease = None
        if isinstance(answer, Acquired):
            lease = _execution.acquired(key, answer, self._policy)
        elif isinstance(answer, Replay):
            _execution.suppressed(key, answer)
        elif _events.on and isinstance(answer, (InProgress, Mismatch)):
            _observed.claimed(key, "in_progress" if isinstance(answer, InProgress) else "mismatch")
        report(key, answer, verdict, self.store)
        return verdict, lease

    def _claim_many(self, requests: list[tuple[str, str]]) -> Flow[list[Any]]:
        return claim_many(self, requests)

    def _replayed(self, outcome: Replay) -> Any:
        """What the first run returned (for adapters that pass results on), else ``None``."""
        try:
            return _execution.replay(outcome, self.codec, Any, self._policy)
        except Exception:  # a stored failure, or a result that cannot be decoded
            return None

    def _unusable(self, exc: Exception) -> Verdict:
        """The verdict of a delivery whose key or fingerprint could not be derived."""
        logger.error(
            "message dead-lettered: no usable idempotency key (%s)",
            exc,
            extra=fields(store=self.store, outcome="dead_lettered"),
        )
        return Verdict(Action.DEAD_LETTER, Reason.INVALID_KEY, error=exc)

    def _failed(self, key: str, attempt: int, exc: Exception) -> Verdict:
        if isinstance(exc, LeaseLostError) and exc.key == key:
            # Overtaken, its transaction rolled back (`Inbox.transactional`): the worker that
            # took the message over decides it; the redelivery is its duplicate.
            return Verdict(Action.RETRY, Reason.LEASE_LOST, key, self._retry_delay(), error=exc)
        final = isinstance(exc, self.policy.dead_letter_on)
        if final or attempt >= self.policy.max_attempts:
            logger.error(
                "message dead-lettered: handler failed key=%s attempt=%d/%d: %r",
                key,
                attempt,
                self.policy.max_attempts,
                exc,
                extra=fields(key=key, attempt=attempt, store=self.store, outcome="dead_lettered"),
            )
            reason = Reason.HANDLER_FAILED if final else Reason.EXHAUSTED
            return Verdict(Action.DEAD_LETTER, reason, key, attempt=attempt, error=exc)
        logger.warning(
            "handler failed key=%s attempt=%d/%d; the message will be redelivered: %r",
            key,
            attempt,
            self.policy.max_attempts,
            exc,
            extra=fields(key=key, attempt=attempt, store=self.store, outcome="retry"),
        )
        return Verdict(Action.RETRY, Reason.HANDLER_FAILED, key, attempt=attempt, error=exc)

    def _settle_failure(
        self, lease: _execution.Lease, verdict: Verdict, exc: Exception
    ) -> Flow[None]:
        """Release the lease of a handler that raised, or record a dead-letter decision.

        A dead-lettered key is stored as failed before the adapter moves the message: if that
        move fails (or the worker dies first), the copy that comes back is dead-lettered again
        without running the handler (see `decide`).
        """
        if verdict.action is not Action.DEAD_LETTER:
            yield from self._release(lease)
            return
        try:
            yield from _execution.settle(lease, "fail", _codec.encode_error(exc), self._policy)
        except OncelyError as settle_exc:  # the lease recovers on expiry; the broker redelivers
            logger.error(
                "could not record the dead letter of key=%s: %s",
                lease.key,
                settle_exc,
                extra=fields(
                    key=lease.key, token=lease.token, store=self.store, outcome="dead_letter_failed"
                ),
            )

    def _release(self, lease: _execution.Lease) -> Flow[None]:
        try:
            yield from _execution.settle(lease, "release", None, self._policy)
        except OncelyError as exc:  # the lease recovers on expiry; the broker redelivers
            logger.error(
                "could not release key=%s: %s",
                lease.key,
                exc,
                extra=fields(
                    key=lease.key, token=lease.token, store=self.store, outcome="release_failed"
                ),
            )

    # -- drivers -----------------------------------------------------------------------------

    def process(self, delivery: Delivery, handler: Callable[[], Any]) -> Verdict:
        """Decide about *delivery* against a sync store, running *handler* if it must run.

        Args:
            delivery: The message as received.
            handler: Runs the user's handler for this message (no arguments).

        Returns:
            The `Verdict` the adapter translates for the broker.
        """
        if _events.on and not _observed.consuming():
            return _observed.process(self, delivery, handler)  # type: ignore[no-any-return]
        store = self._required(SyncStore)
        return _execution.run(self.flow(delivery), store, handler)

    async def aprocess(self, delivery: Delivery, handler: Callable[[], Awaitable[Any]]) -> Verdict:
        """Async `process`: *handler* returns an awaitable.

        With a store that has the batch verbs and `ConsumerPolicy.coalesce`, the deliveries
        handled at once (one task each, as aio-pika and nats-py run callbacks) share their
        store calls through one `oncely.stores._coalescing.CoalescingStore`: a few calls go to
        the store at once, and the claims (completions) made meanwhile go together in the next
        batch call (group commit). A copy of a delivery being processed here waits for it (up
        to `ConsumerPolicy.retry_delay`) before it claims. Every delivery runs through `flow`
        (with ``ONCELY_REFERENCE_FLOWS``, against the store itself, one call at a time).
        """
        if _events.on and not _observed.consuming() and not _switches.disabled:
            return await _observed.aprocess(self, delivery, handler)  # type: ignore[no-any-return]
        grouped = self._async_calls
        if grouped is None or grouped[0] is not asyncio.get_running_loop():
            grouped = self._grouped()
        coalescing, running = grouped[1], grouped[2]
        if coalescing is None or _switches.disabled or _switches.reference_flows:
            return await _execution.arun(self.flow(delivery), self.store, handler)  # type: ignore[arg-type]
        try:
            key = self.key_for(delivery)
            fingerprint = self.fingerprint_for(delivery)
        except Exception as exc:
            return self._verdict(self._unusable(exc))
        if key in running:
            # A copy of a delivery this consumer is running: claimed now, it would be retried
            # after retry_delay. It waits for that run (as long at most), then claims: mostly
            # a completed duplicate then, acked at once. The store decides, as ever.
            first = running[key]
            if first is None:  # the first copy to wait makes the run's future
                first = running[key] = asyncio.get_running_loop().create_future()
            await asyncio.wait((first,), timeout=self.policy.retry_delay.total_seconds())
            return await self._agrouped(coalescing, key, fingerprint, handler)
        running[key] = None  # no future unless a copy waits for this run: most never do
        try:
            return await self._agrouped(coalescing, key, fingerprint, handler)
        finally:
            mine = running.pop(key)
            if mine is not None:
                mine.set_result(None)

    async def _agrouped(
        self,
        coalescing: CoalescingStore,
        key: str,
        fingerprint: str,
        handler: Callable[[], Awaitable[Any]],
    ) -> Verdict:
        """`flow` from the claim on, written out against the grouped store: no generator and
        no task per store call (half the cost per delivery, measured in process). `flow` stays
        the reference: tests/consumers/test_reference_flow.py holds both to the same verdicts,
        and ``ONCELY_REFERENCE_FLOWS`` makes `aprocess` take it."""
        policy = self._policy
        try:
            answer: object = await coalescing.aclaim(
                key, fingerprint, lease=policy.lease, ttl=policy.ttl
            )
        except StoreError as exc:
            answer = exc
        verdict, lease = self._claimed(key, answer)
        if verdict is not None:
            if lease is not None:  # exhausted: given back, not run
                await _execution.arun(self._release(lease), coalescing)
            return self._verdict(verdict)
        assert lease is not None
        return await self._arun_acquired(coalescing, lease, handler)

    async def _arun_acquired(
        self,
        coalescing: CoalescingStore,
        lease: _execution.Lease,
        handler: Callable[[], Awaitable[Any]],
    ) -> Verdict:
        """`flow` from the lease on, written out (see `_agrouped`): the handler runs under
        *lease*, its outcome recorded through *coalescing*; the verdict, counted."""
        key = lease.key
        if self._policy.heartbeat:
            await _execution.aperform(_execution.StartHeartbeat(lease), coalescing)
        try:
            value = await _execution.ainvoke_under(lease, handler)
        except ConfigurationError:
            await _execution.arun(self._release(lease), coalescing)  # not the message's failure
            raise
        except Exception as exc:
            verdict = self._failed(key, lease.attempt, exc)
            await _execution.arun(self._settle_failure(lease, verdict, exc), coalescing)
            return self._verdict(verdict)
        except BaseException:  # cancelled: give the lease back, then go on being cancelled
            await _execution.arun(self._release(lease), coalescing)
            raise
        lease.settling = True  # an extend landing after the completion answers LeaseLost
        if lease.heartbeat is not None:  # before the completion: an extend after it is refused
            await _execution.aperform(_execution.StopHeartbeat(lease), coalescing)
        if lease.committed:  # completed in the handler's own transaction (Inbox.transactional)
            return self._verdict(settled_verdict(self, lease, value, None))
        payload = encoded(lease, value, self.codec)
        outcome = await acomplete(self, lease, payload, coalescing)
        return self._verdict(settled_verdict(self, lease, value, outcome))

    def _grouped(
        self,
    ) -> tuple[Any, CoalescingStore | None, dict[str, asyncio.Future[None] | None]]:
        """What `aprocess` uses on this event loop, checked once per loop: the loop, the
        store's calls grouped (``None`` without the batch verbs or `ConsumerPolicy.coalesce`;
        the consumer's `CoalescingStore`, see `_calls_to`), and the keys of the
        deliveries being processed here (each with the future its copies wait for, made by the
        first copy that waits)."""
        store = self._required(AsyncStore)
        coalescing = self._calls_to(store) if self.policy.coalesce and self.batches else None
        grouped: tuple[Any, CoalescingStore | None, dict[str, asyncio.Future[None] | None]] = (
            asyncio.get_running_loop(),
            coalescing,
            {},
        )
        self._async_calls = grouped
        return grouped

    def _calls_to(self, store: Any) -> CoalescingStore:
        """The `CoalescingStore` that groups this consumer's calls to *store*: made once per
        store (it inspects the store's verbs) and shared by every delivery and batch (it keeps
        its state per event loop); another one once the store is replaced."""
        grouped = self._coalescing
        if grouped is None or grouped.store is not store:
            grouped = self._coalescing = CoalescingStore(store, max_in_flight=1, singles=False)
        return grouped

    def process_batch(
        self, deliveries: Sequence[Delivery], handler: Callable[[Any], Any]
    ) -> list[Verdict]:
        """Decide about a fetched batch (see `batch_flow`) against a sync store.

        Args:
            deliveries: The batch, in the broker's order.
            handler: Called with the ``raw`` message of each delivery that must run.

        Returns:
            One `Verdict` per delivery, in order.
        """
        store = self._required(SyncStore)
        return run_with(self.batch_flow(deliveries), store, handler, no_broker)

    async def aprocess_batch(
        self, deliveries: Sequence[Delivery], handler: Callable[[Any], Awaitable[Any]]
    ) -> list[Verdict]:
        """Async `process_batch`: *handler* returns an awaitable.

        With a store that has the batch verbs, `batch_flow` written out (`abatched`): the same
        claims, runs and completions, without a flow's generators and operations per delivery.
        `batch_flow` stays the reference (``ONCELY_REFERENCE_FLOWS`` makes this take it).
        """
        store = self._required(AsyncStore)
        if self.batches and not (_switches.disabled or _switches.reference_flows or _events.on):
            return await abatched(self, deliveries, handler)
        return await arun_with(self.batch_flow(deliveries), store, handler, ano_broker)
