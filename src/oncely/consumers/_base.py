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
import concurrent.futures
import contextlib
import inspect
import secrets
import threading
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeGuard, TypeVar

from oncely import _events, _execution, _observed, _switches
from oncely._cancel import give_back, shielded
from oncely._core import codec as _codec
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import (
    body_digest,
    canonical_body,
    canonical_json,
    digest,
    parse_document,
)
from oncely._core.flow import Flow, adrive, drive
from oncely._core.keys import content_key, name_key, scope_key, validate_key
from oncely._core.machine import landed
from oncely._core.protocols import AsyncStore, BatchStore, SyncStore
from oncely._core.records import Acquired, InProgress, LeaseLost, Mismatch, Replay
from oncely._log import fields, get_logger
from oncely.consumers._decision import decide, report, retry_delay
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
    seconds,
)
from oncely.errors import (
    ConfigurationError,
    InvalidKeyError,
    LeaseLostError,
    OncelyError,
    StoreError,
    StoreUnavailableError,
)
from oncely.keys import from_header
from oncely.stores._batch import takes_ops

__all__ = [
    "Action",
    "ano_broker",
    "arun_with",
    "BATCH_VERBS",
    "body_value",
    "BrokerOp",
    "ConsumerPolicy",
    "ConsumerStats",
    "default_scope",
    "Delivery",
    "FingerprintSource",
    "Handle",
    "IdempotentConsumer",
    "KEY_HEADERS",
    "KeySource",
    "no_broker",
    "Parallel",
    "Run",
    "Reason",
    "run_with",
    "seconds",
    "Verdict",
]

logger = get_logger(__name__)

T = TypeVar("T")

BATCH_VERBS: tuple[str, ...] = ("claim_many", "complete_many", "aclaim_many", "acomplete_many")
"""The verbs of `oncely.BatchStore` (whose docstring is their contract), which
`IdempotentConsumer.batch_flow` uses when a store has all of them."""


# -- keys and fingerprints ---------------------------------------------------------------------


def body_value(body: bytes) -> Any:
    """Return *body* parsed as JSON when it is JSON, else the bytes themselves.

    Numbers with a fraction or an exponent are `decimal.Decimal` (every digit kept), so keys
    and fingerprints derived from the result are exact and do not change with JSON key order,
    spacing or number formatting. A body nested too deeply or with a number out of range is
    returned as bytes.
    """
    try:
        return parse_document(body)
    except ValueError:  # UnicodeDecodeError included
        return body


def _body_fingerprint(body: bytes) -> str:
    """Return the fingerprint of a message body: its canonical JSON when it is JSON (numbers
    compared exactly, as decimals), else its bytes."""
    return body_digest(body)


def _content_key(delivery: Delivery) -> str:
    """``content_hash(body_value(body))``, exact; a body without a canonical JSON form (not
    JSON, NaN, nested too deeply) is keyed by its bytes, as ``content_hash(body)``."""
    body = delivery.body
    text = canonical_body(body)
    return content_key(canonical_json(body) if text is None else text)


def _header_key(delivery: Delivery, headers: tuple[str, ...]) -> str:
    for name in headers:
        value = delivery.header(name)
        if value is not None:
            return from_header(value)
    if delivery.message_id:
        return from_header(delivery.message_id)
    raise KeyError(
        f"the message has none of the headers {', '.join(headers)} and no message id: "
        "stamp a key on it (oncely.consumers.producer) or configure key="
    )


# -- the runner --------------------------------------------------------------------------------


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
        self._policy = self.policy.as_policy()
        self._async_calls: Any = None  # what aprocess calls: see _async_store
        self._takes_ops: bool | None = None  # whether claim_many takes call ids, once known

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
        return scope_key(self.scope, raw)

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
        return isinstance(self.store, BatchStore)

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
                    verdicts.append(self._verdict(self._blocked(None)))
                    continue
                verdicts.append((yield Handle(delivery.raw, self.flow(delivery))))
            return verdicts
        return (yield from self._batched(deliveries, ordered, {} if held is None else held))

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

    def _blocked(self, key: str | None) -> Verdict:
        return Verdict(Action.RETRY, Reason.BLOCKED, key, self._retry_delay())

    def _batched(
        self,
        deliveries: Sequence[Delivery],
        ordered: bool,
        held: MutableMapping[str, _execution.Lease],
    ) -> Flow[list[Verdict]]:
        verdicts: list[Verdict | None] = [None] * len(deliveries)
        firsts: dict[str, int] = {}  # key -> index of its first copy in the batch
        copies: dict[int, list[int]] = {}
        prints: dict[str, str] = {}
        for index, delivery in enumerate(deliveries):
            try:
                key = self.key_for(delivery)
                fingerprint = self.fingerprint_for(delivery)
            except Exception as exc:
                verdicts[index] = self._verdict(self._unusable(exc))
                continue
            if key in firsts:
                if prints[key] != fingerprint:
                    logger.error(
                        "message dead-lettered: key=%s was used for another payload",
                        key,
                        extra=fields(key=key, store=self.store, outcome="dead_lettered"),
                    )
                    verdicts[index] = self._verdict(
                        Verdict(Action.DEAD_LETTER, Reason.MISMATCH, key)
                    )
                else:
                    copies[firsts[key]].append(index)
                continue
            firsts[key], prints[key], copies[index] = index, fingerprint, []
        policy = self._policy
        if firsts:
            leases: list[tuple[int, _execution.Lease]] = []
            # Taken out of *held* at once, before any store call: a mapping shared with
            # flows running meanwhile (other partitions) hands each lease to one of them.
            kept_leases = {key: held.pop(key) for key in firsts if key in held}
            claims = {key: index for key, index in firsts.items() if key not in kept_leases}
            for key, kept in kept_leases.items():
                index = firsts[key]
                # Blocked last time and not kept alive since: still ours unless it lapsed and
                # another worker took the key over (and maybe ran it). Extending tells which.
                try:
                    renewed = yield _execution.StoreCall(
                        "extend", (key, kept.token), {"lease": policy.lease}
                    )
                except StoreError as exc:  # kept: the next round asks again
                    held[key] = kept
                    logger.warning(
                        "store error renewing key=%s; redelivering later: %s",
                        key,
                        exc,
                        extra=fields(key=key, store=self.store, outcome="store_unavailable"),
                    )
                    delay = self._retry_delay()
                    verdicts[index] = self._verdict(
                        Verdict(Action.RETRY, Reason.STORE_UNAVAILABLE, key, delay, error=exc)
                    )
                    continue
                if isinstance(renewed, LeaseLost):
                    kept.lost = True
                    logger.warning(
                        "held lease lost key=%s token=%d; claiming again",
                        key,
                        kept.token,
                        extra=fields(
                            key=key, token=kept.token, store=self.store, outcome="lease_lost"
                        ),
                    )
                    claims[key] = index
                else:
                    leases.append((index, kept))
            requests = [(key, prints[key]) for key in claims]
            answers: list[Any] = []
            slots: dict[str, _Slot] = {}
            if requests:
                slots = yield _Share(tuple(claims))
                answers = yield from self._claim_many(requests)
            runs: list[tuple[int, _execution.Lease | _Later]] = [*leases]
            for (key, index), answer in zip(claims.items(), answers, strict=True):
                slot = slots.get(key)
                if slot is not None:
                    slot.claiming -= 1
                    if isinstance(answer, InProgress) and slot.flows > 1:
                        # Maybe claimed by another flow of this run (another partition's
                        # copy): run under its lease if it has not started, else wait for it.
                        runs.append((index, _Later(key, prints[key], slot)))
                        continue
                verdict, lease = self._claimed(key, answer)
                if verdict is None:
                    assert lease is not None
                    if slot is not None:
                        slot.owned, slot.fingerprint = True, prints[key]
                    runs.append((index, lease))
                    continue
                if lease is not None:  # exhausted: given back, not run
                    yield from self._release(lease)
                verdicts[index] = self._verdict(verdict)
            idle = [slot for slot in slots.values() if not slot.claiming and not slot.owned]
            if idle:  # nobody here got these keys: their other copies need not wait
                yield _Decide(idle)
            runs.sort(key=lambda pair: pair[0])
            if ordered:  # leases after the first retry are kept for next time, unused
                stop = min(
                    (i for i, v in enumerate(verdicts) if v and v.action is Action.RETRY),
                    default=len(deliveries),
                )
                for index, run in runs:
                    if index > stop:
                        if isinstance(run, _execution.Lease):
                            held[run.key] = run
                        verdicts[index] = self._verdict(self._blocked(run.key))
                runs = [(i, run) for i, run in runs if i < stop]
            ran = yield from self._run_batch(deliveries, runs, slots, held if ordered else None)
            for index, verdict in ran:
                verdicts[index] = self._verdict(verdict)
            if slots:
                yield _Decide(list(slots.values()))
        for first, others in copies.items():
            outcome = verdicts[first]
            assert outcome is not None
            for index in others:
                if outcome.action is Action.ACK:
                    logger.info(
                        "duplicate suppressed key=%s status=in_batch",
                        outcome.key,
                        extra=fields(key=outcome.key, store=self.store, outcome="in_batch"),
                    )
                    copy = Verdict(Action.ACK, Reason.DUPLICATE, outcome.key, result=outcome.result)
                else:  # redelivered: a later claim decides it (never dead-lettered twice here)
                    copy = Verdict(
                        Action.RETRY, Reason.IN_PROGRESS, outcome.key, self._retry_delay()
                    )
                verdicts[index] = self._verdict(copy)
        settled = [verdict for verdict in verdicts if verdict is not None]
        assert len(settled) == len(deliveries)
        return settled

    def _claim_many(self, requests: list[tuple[str, str]]) -> Flow[list[Any]]:
        """Claim every request in one call. A call whose outcome is unknown (it timed out, or
        its connection broke) is sent once more to learn each item's, with the same call ids
        when the store takes them (``ops``): a claim applied with its reply lost then answers
        `Acquired`. Without ids, an item answered `InProgress` may hold its own first claim and
        keeps the error (never run: its lease, if it is ours, expires on its own); the others
        get their answers."""
        options: dict[str, Any] = {"lease": self._policy.lease, "ttl": self._policy.ttl}
        ops: list[str] | None = None
        if self._takes_ops is None:  # both twins: a subclass may override one without ids
            verbs = (getattr(self.store, name, None) for name in ("claim_many", "aclaim_many"))
            self._takes_ops = all(takes_ops(verb) for verb in verbs if verb is not None)
        if self._takes_ops:  # the same ids if sent again; unique: a random prefix per call
            prefix = secrets.token_hex(8)
            ops = [f"{prefix}.{i}" for i in range(len(requests))]
        call = _execution.StoreCall(
            "claim_many", (requests,), options if ops is None else {**options, "ops": ops}
        )
        try:
            answers: list[Any] = yield call
        except StoreUnavailableError as exc:
            answers = [exc] * len(requests)
        except StoreError as exc:
            logger.warning(
                "store error claiming a batch; redelivering later: %s",
                exc,
                extra=fields(store=self.store, outcome="store_unavailable"),
            )
            return [exc] * len(requests)
        unknown = [
            i for i, answer in enumerate(answers) if isinstance(answer, StoreUnavailableError)
        ]
        if not unknown:
            return answers
        try:
            kwargs = options if ops is None else {**options, "ops": [ops[i] for i in unknown]}
            again: list[Any] = yield _execution.StoreCall(
                "claim_many", ([requests[i] for i in unknown],), kwargs
            )
        except StoreError:
            again = [answers[i] for i in unknown]
        answers = list(answers)
        for i, answer in zip(unknown, again, strict=True):
            if ops is not None and not isinstance(answer, StoreError):
                answers[i] = answer  # with its own id, its own applied claim is Acquired
            elif not isinstance(answer, (InProgress, StoreError)):
                answers[i] = answer
            elif isinstance(answer, InProgress):
                logger.warning(
                    "claim of key=%s may have been applied; it recovers after its lease",
                    requests[i][0],
                    extra=fields(key=requests[i][0], store=self.store, outcome="store_unavailable"),
                )
        errors = [answer for answer in answers if isinstance(answer, StoreError)]
        if errors:
            logger.warning(
                "store error claiming a batch; redelivering later: %s",
                errors[0],
                extra=fields(store=self.store, outcome="store_unavailable"),
            )
        return answers

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

    def _run_batch(
        self,
        deliveries: Sequence[Delivery],
        runs: list[tuple[int, _execution.Lease | _Later]],
        slots: Mapping[str, _Slot],
        held: MutableMapping[str, _execution.Lease] | None,
    ) -> Flow[list[tuple[int, Verdict]]]:
        """Run the handlers of the acquired leases, each completed as soon as it returns.

        A completion goes to the store at once, while the next handlers run, and those that
        finish meanwhile go together as one batch call (`_Complete`): a worker killed in one
        handler leaves the earlier ones completed, never to run again. Ordered batches (*held*
        given) run their handlers one after the other and stop at the first one to retry;
        others run them as a `Parallel` (concurrently when async).

        A lease whose key another flow of the same run also has (*slots*, `_Later`) is run by
        whichever of the two reaches it first; the other waits for that run.
        """
        policy = self._policy
        leases = [run for _, run in runs if isinstance(run, _execution.Lease)]
        if policy.heartbeat:
            for lease in leases:
                yield _execution.StartHeartbeat(lease)
        for lease in leases:  # from now on, another flow of the run may take it (`_later`)
            slot = slots.get(lease.key)
            if slot is not None:
                slot.lease = lease
        acquired: list[_execution.Lease] = []  # leases of other flows run here, late claims
        verdicts: list[tuple[int, Verdict]] = []
        finished: list[tuple[int, _execution.Lease, Any, Any]] = []
        try:
            if held is None:
                starts = [self._start(deliveries[i].raw, run, slots, acquired) for i, run in runs]
                outcomes_of_runs = yield Parallel(starts)
            else:
                outcomes_of_runs = []
                blocked = False
                for position, (index, run) in enumerate(runs):
                    if blocked:
                        if _withdrawn(run, slots):  # ours, not started: for the next round
                            held[run.key] = run
                            yield from _decided(slots.get(run.key))
                        outcomes_of_runs.append(None)
                        continue
                    try:
                        ran = yield from self._start(deliveries[index].raw, run, slots, acquired)
                    except BaseException:
                        for _, left in runs[position + 1 :]:
                            if _withdrawn(left, slots):
                                yield from self._release(left)
                        raise
                    blocked = isinstance(ran, Verdict) and ran.action is Action.RETRY
                    outcomes_of_runs.append(ran)
            for (index, run), ran in zip(runs, outcomes_of_runs, strict=True):
                if ran is None:
                    verdicts.append((index, self._blocked(run.key)))
                elif isinstance(ran, Verdict):
                    verdicts.append((index, ran))
                else:
                    finished.append((index, *ran))
            outcomes: list[Any] = []
            if finished:
                outcomes = yield _Completed([sent for *_, sent in finished])
        finally:
            for lease in leases:
                _withdrawn(lease, slots)  # an error: nobody starts it now
            taken = {id(slot.taken) for slot in slots.values() if slot.taken is not None}
            for lease in [*(lease for lease in leases if id(lease) not in taken), *acquired]:
                if lease.heartbeat is not None:
                    yield _execution.StopHeartbeat(lease)
        for (index, lease, value, _), outcome in zip(finished, outcomes, strict=True):
            verdicts.append((index, self._settled(lease, value, outcome)))
        return verdicts

    def _start(
        self,
        message: Any,
        run: _execution.Lease | _Later,
        slots: Mapping[str, _Slot],
        acquired: list[_execution.Lease],
    ) -> Flow[tuple[_execution.Lease, Any, Any] | Verdict]:
        """Run *message* under its lease (`_run_one`), unless another flow of the run has
        started it: then it is a copy of that run (`_later`)."""
        if isinstance(run, _Later):
            return (yield from self._later(message, run, acquired))
        slot = slots.get(run.key)
        if slot is not None:
            if slot.lease is not run:  # another flow took it: this delivery is its copy
                assert slot.fingerprint is not None
                later = _Later(run.key, slot.fingerprint, slot)
                return (yield from self._later(message, later, acquired))
            slot.lease = None
        return (yield from self._run_one(message, run, slot))

    def _later(
        self, message: Any, later: _Later, acquired: list[_execution.Lease]
    ) -> Flow[tuple[_execution.Lease, Any, Any] | Verdict]:
        """A copy of a key another flow of this run claimed: run under that flow's lease if it
        has not started it (same fingerprint), else wait for that run (`retry_delay` at most)
        and claim: a completed duplicate then, mostly. The store decides, as ever."""
        slot = later.slot
        if slot.lease is None:
            yield _Wait(slot, self.policy.retry_delay.total_seconds())
        lease = slot.lease
        if lease is not None and slot.fingerprint == later.fingerprint:
            slot.lease, slot.taken = None, lease
            acquired.append(lease)
            return (yield from self._run_one(message, lease, slot))
        answers = yield from self._claim_many([(later.key, later.fingerprint)])
        verdict, lease = self._claimed(later.key, answers[0])
        if verdict is not None:
            if lease is not None:  # exhausted: given back, not run
                yield from self._release(lease)
            return verdict
        assert lease is not None
        acquired.append(lease)
        if self._policy.heartbeat:
            yield _execution.StartHeartbeat(lease)
        return (yield from self._run_one(message, lease, None))

    def _settled(self, lease: _execution.Lease, value: Any, outcome: Any) -> Verdict:
        """The verdict of a handler that returned *value*, once its completion answered
        *outcome* (`_Completed`): acked only when the record is completed."""
        key = lease.key
        if outcome is None:
            return Verdict(Action.ACK, Reason.PROCESSED, key, attempt=lease.attempt, result=value)
        if isinstance(outcome, LeaseLost):
            lease.lost = True
            logger.error(
                "lease lost key=%s token=%d on complete",
                key,
                lease.token,
                extra=fields(key=key, token=lease.token, store=self.store, outcome="lease_lost"),
            )
            return Verdict(Action.RETRY, Reason.LEASE_LOST, key, self._retry_delay())
        # an error for this item alone, or for the whole call
        return Verdict(
            Action.RETRY, Reason.STORE_UNAVAILABLE, key, self._retry_delay(), error=outcome
        )

    def _run_one(
        self, message: Any, lease: _execution.Lease, slot: _Slot | None = None
    ) -> Flow[tuple[_execution.Lease, Any, Any] | Verdict]:
        """Run one handler and send its completion off at once: ``(lease, value, handle)``
        (the handle answers the completion, see `_Completed`), or the verdict of its failure.
        *slot* (the key's, shared with other flows) is decided once the completion lands."""
        ran = yield from self._guarded(message, lease)
        if isinstance(ran, Verdict):
            yield from _decided(slot)
            return ran
        if lease.committed:  # completed in the handler's own transaction (Inbox.transactional)
            yield from _decided(slot)
            return self._settled(lease, ran[0], None)
        lease.settling = True  # an extend landing after the completion answers LeaseLost
        if lease.heartbeat is not None:  # before the completion: an extend after it is refused
            yield _execution.StopHeartbeat(lease)
        item = (lease.key, lease.token, _encoded(lease, ran[0], self.codec))
        sent = yield _Complete(item, self._complete_many, slot)
        return lease, ran[0], sent

    def _guarded(self, message: Any, lease: _execution.Lease) -> Flow[tuple[Any] | Verdict]:
        """Run one handler: ``(value,)``, or the verdict of its failure (lease released)."""
        try:
            value = yield Run(message, lease)
        except ConfigurationError:
            yield from self._release(lease)  # not the message's failure: never redelivered as one
            raise
        except Exception as exc:
            verdict = self._failed(lease.key, lease.attempt, exc)
            yield from self._settle_failure(lease, verdict, exc)
            return verdict
        except BaseException:  # cancelled: give the lease back, then go on being cancelled
            yield from self._release(lease)
            raise
        return (value,)

    def _complete_many(self, items: list[tuple[str, int, bytes]]) -> Flow[list[Any]]:
        """Complete every item in one call, retrying while the store is briefly unavailable."""
        retried = False
        for delay in (*_execution.SETTLE_RETRY_DELAYS, None):
            try:
                answers: list[Any] = yield _execution.StoreCall(  # the handlers ran: shielded
                    "complete_many", (items,), {"ttl": self._policy.ttl}, shield=True
                )
            except StoreUnavailableError as exc:
                if delay is None:
                    logger.error(
                        "could not complete a batch: the store is unavailable: %s",
                        exc,
                        extra=fields(store=self.store, outcome="complete_failed"),
                    )
                    return [exc] * len(items)
                retried = True
                yield _execution.Sleep(delay)
            except StoreError as exc:
                logger.error(
                    "could not complete a batch: %s",
                    exc,
                    extra=fields(store=self.store, outcome="complete_failed"),
                )
                return [exc] * len(items)
            else:
                if retried:
                    answers = yield from self._applied(items, answers)
                return answers
        raise AssertionError("unreachable")  # pragma: no cover

    def _applied(self, items: list[tuple[str, int, bytes]], answers: list[Any]) -> Flow[list[Any]]:
        """A completion sent again after a call whose reply was lost answers LeaseLost when
        that call was applied: the record then shows this token completed with this result."""
        answers = list(answers)
        for i, ((key, token, result), answer) in enumerate(zip(items, answers, strict=True)):
            if not isinstance(answer, LeaseLost):
                continue
            try:
                record = yield _execution.StoreCall("get", (key,))
            except StoreError:
                continue
            if landed(record, token, "complete", result):
                answers[i] = None
        return answers

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
        store = _require(self.store, SyncStore)
        return _execution.run(self.flow(delivery), store, handler)

    async def aprocess(self, delivery: Delivery, handler: Callable[[], Awaitable[Any]]) -> Verdict:
        """Async `process`: *handler* returns an awaitable.

        With a store that has the batch verbs and `ConsumerPolicy.coalesce`, the deliveries
        handled at once (one task each, as aio-pika and nats-py run callbacks) share their
        store calls: one claim call in flight at a time, the claims made meanwhile going
        together in the next one, and likewise for completions (group commit, `_AsyncGroups`).
        A copy of a delivery being processed here waits for it (up to
        `ConsumerPolicy.retry_delay`) before it claims. The common path (a new key that
        completes, a finished duplicate) is a straight line; every other answer goes through
        the batch path's decisions.
        """
        if _switches.disabled:
            return await _execution.arun(
                self.flow(delivery), _require(self.store, AsyncStore), handler
            )
        if _events.on and not _observed.consuming():
            return await _observed.aprocess(self, delivery, handler)  # type: ignore[no-any-return]
        groups = self._async_calls
        if groups is None:  # not `or`: a store with no records may be falsy (it has a len)
            groups = self._async_store()
        if type(groups) is _Settling:
            return await _execution.arun(self.flow(delivery), groups, handler)
        if groups.loop is not asyncio.get_running_loop():
            groups = self._async_store()
        try:
            key = self.key_for(delivery)
            fingerprint = self.fingerprint_for(delivery)
        except Exception as exc:
            return self._verdict(self._unusable(exc))
        running = groups.running
        first = running.get(key)
        if first is not None:
            # A copy of a delivery this consumer is running: claimed now, it would be retried
            # after retry_delay. It waits for that run (as long at most), then claims: mostly
            # a completed duplicate then, acked at once. The store decides, as ever.
            await asyncio.wait((first,), timeout=self.policy.retry_delay.total_seconds())
            return await self._agrouped(groups, key, fingerprint, handler)
        mine = running[key] = groups.loop.create_future()
        try:
            return await self._agrouped(groups, key, fingerprint, handler)
        finally:
            del running[key]
            mine.set_result(None)

    async def _agrouped(
        self,
        groups: _AsyncGroups,
        key: str,
        fingerprint: str,
        handler: Callable[[], Awaitable[Any]],
    ) -> Verdict:
        """`aprocess` from the claim on, with claims and completions grouped."""
        answer = await groups.claim(_Claim((key, fingerprint), self._claim_many))
        verdict, lease = self._claimed(key, answer)
        perform = groups.perform
        if verdict is not None:
            if lease is not None:  # exhausted: given back, not run
                await adrive(self._release(lease), perform)
            return self._verdict(verdict)
        assert lease is not None
        if self._policy.heartbeat:
            await perform(_execution.StartHeartbeat(lease))
        try:
            value = await _execution.ainvoke_under(lease, handler)
        except ConfigurationError:
            await adrive(self._release(lease), perform)  # not the message's failure
            raise
        except Exception as exc:
            verdict = self._failed(key, lease.attempt, exc)
            await adrive(self._settle_failure(lease, verdict, exc), perform)
            return self._verdict(verdict)
        except BaseException:  # cancelled: give the lease back, then go on being cancelled
            await adrive(self._release(lease), perform)
            raise
        lease.settling = True  # an extend landing after the completion answers LeaseLost
        if lease.heartbeat is not None:  # before the completion: an extend after it is refused
            await perform(_execution.StopHeartbeat(lease))
        if lease.committed:  # completed in the handler's own transaction (Inbox.transactional)
            return self._verdict(self._settled(lease, value, None))
        item = (key, lease.token, _encoded(lease, value, self.codec))
        outcome = await groups.complete(_Complete(item, self._complete_many))
        return self._verdict(self._settled(lease, value, outcome))

    def _async_store(self) -> Any:
        """What `aprocess` calls, checked once (per event loop when grouping): the store's
        claim and completion groups (`_AsyncGroups`), or the store with completions that
        finish even if their caller is cancelled (`_Settling`)."""
        store = _require(self.store, AsyncStore)
        if self.policy.coalesce and self.batches:
            self._async_calls = _AsyncGroups(store)
        else:
            self._async_calls = _Settling(store)
        return self._async_calls

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
        store = _require(self.store, SyncStore)
        return run_with(self.batch_flow(deliveries), store, handler, no_broker)

    async def aprocess_batch(
        self, deliveries: Sequence[Delivery], handler: Callable[[Any], Awaitable[Any]]
    ) -> list[Verdict]:
        """Async `process_batch`: *handler* returns an awaitable."""
        store = _require(self.store, AsyncStore)
        return await arun_with(self.batch_flow(deliveries), store, handler, ano_broker)


class _Settling:
    """An async store whose completions go on when their caller is cancelled (a consumer
    shutting down): the handler has returned, and a completion cut short would leave the
    record in progress, for the message to run again after the lease."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def acomplete(
        self, key: str, token: int, result: bytes, *, ttl: timedelta
    ) -> LeaseLost | None:
        answer: LeaseLost | None = await _finishing(
            self.store.acomplete(key, token, result, ttl=ttl)
        )
        return answer

    async def acomplete_many(
        self, items: Sequence[tuple[str, int, bytes]], *, ttl: timedelta
    ) -> list[Any]:
        answers: list[Any] = await _finishing(self.store.acomplete_many(items, ttl=ttl))
        return answers


async def _finishing(call: Awaitable[T]) -> T:
    """Await *call*, which goes on to its end if the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(call)
    _SENDING.add(task)  # a reference, so the task is not collected mid-flight
    task.add_done_callback(_SENDING.discard)
    return await asyncio.shield(task)


def _encoded(lease: _execution.Lease, value: Any, codec: Codec) -> bytes:
    """The stored form of *value*; one that cannot be encoded is stored as unavailable."""
    try:
        return _codec.encode_value(codec.encode(value))
    except Exception as exc:
        logger.warning(
            "result of key=%s cannot be serialised (%s); replays will raise ResultUnavailableError",
            lease.key,
            exc,
            extra=fields(key=lease.key, token=lease.token, outcome="unserialisable"),
        )
        return _codec.encode_unavailable(f"{type(exc).__name__}: {exc}")


def default_scope(handler: Callable[..., Any], group: str | None) -> str:
    """Return *group*, or the handler's qualified name: the scope of an adapter's keys."""
    if group:
        return group
    target = getattr(handler, "func", handler)  # functools.partial
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{name}" if module else name


def no_broker(op: BrokerOp) -> Any:
    """The *broker* of `run_with` for flows that yield no broker operation of their own."""
    raise TypeError(f"cannot perform {op!r}")


async def ano_broker(op: BrokerOp) -> Any:
    """Async `no_broker`."""
    raise TypeError(f"cannot perform {op!r}")


def _require(store: Any, kind: type[Any]) -> Any:
    if not isinstance(store, kind):
        raise ConfigurationError(f"{type(store).__name__} is not a {kind.__name__}")
    return store


# -- adapters' own flows -------------------------------------------------------------------------


class BrokerOp:
    """Base class of the operations an adapter's flow yields for the adapter to perform."""


@dataclass(frozen=True, slots=True, eq=False)
class Handle(BrokerOp):
    """Run *flow* (usually `IdempotentConsumer.flow`) with the handler bound to *message*."""

    message: Any
    flow: Flow[Any]


@dataclass(frozen=True, slots=True, eq=False)
class Run(BrokerOp):
    """Run the handler on *message* under *lease* (the batch path's `Invoke`)."""

    message: Any
    lease: _execution.Lease


@dataclass(frozen=True, slots=True, eq=False)
class Parallel(BrokerOp):
    """Run *flows* (one per partition, say): concurrently when async, in order when sync."""

    flows: Sequence[Flow[Any]]


@dataclass(frozen=True, slots=True, eq=False)
class _Complete:
    """Send the completion *item* now, without waiting for its answer: answers a handle.

    *many* is the flow that completes a list of items (`IdempotentConsumer._complete_many`);
    *decided*, the key's `_Slot`, is decided once the completion has landed.
    """

    item: tuple[str, int, bytes]
    many: Callable[[list[tuple[str, int, bytes]]], Flow[list[Any]]]
    decided: _Slot | None = None


@dataclass(slots=True, eq=False)
class _Slot:
    """One key that the flows of one async run (`arun_with`; a Kafka member's partitions of one
    poll) claim at once: the lease of the flow that got it, until that flow or another one
    starts running it, so that a copy in another partition runs under it or waits for it
    rather than finding the key busy (and retrying after a delay)."""

    done: asyncio.Future[None]
    """Done once the key is decided here (its completion landed, or nobody runs it now)."""
    flows: int = 0
    """The flows that claimed the key (more than one: an in-progress answer may be theirs)."""
    claiming: int = 0
    """The flows whose claim has not answered yet."""
    owned: bool = False
    """Whether one flow of the run got the lease."""
    fingerprint: str | None = None
    """The fingerprint it was claimed with (a copy with another one does not take it)."""
    lease: _execution.Lease | None = None
    """The lease, while nobody has started running it."""
    taken: _execution.Lease | None = None
    """The lease, once another flow than its claimer took it (that flow stops its beat)."""

    def decide(self, *_: Any) -> None:
        if not self.done.done():
            self.done.set_result(None)


@dataclass(frozen=True, slots=True, eq=False)
class _Later:
    """A delivery whose claim answered in progress while another flow of the run claimed its
    key: run by `IdempotentConsumer._later`."""

    key: str
    fingerprint: str
    slot: _Slot


@dataclass(frozen=True, slots=True, eq=False)
class _Share:
    """The `_Slot` of each of *keys*, shared with the other flows of the run that claim them
    (none with a sync store: its flows run one after the other)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True, eq=False)
class _Wait:
    """Wait until *slot* is decided, at most *timeout* seconds."""

    slot: _Slot
    timeout: float


@dataclass(frozen=True, slots=True, eq=False)
class _Decide:
    """Mark these slots decided: their copies need not wait any longer."""

    slots: Sequence[_Slot]


def _withdrawn(
    run: _execution.Lease | _Later, slots: Mapping[str, _Slot]
) -> TypeGuard[_execution.Lease]:
    """Take back *run*, a lease of this flow that no other flow has started; whether it was
    (a `_Later` is not this flow's)."""
    if not isinstance(run, _execution.Lease):
        return False
    slot = slots.get(run.key)
    if slot is None:
        return True
    if slot.lease is run:
        slot.lease = None
        return True
    return False


def _decided(slot: _Slot | None) -> Flow[None]:
    if slot is not None:
        yield _Decide((slot,))


@dataclass(frozen=True, slots=True, eq=False)
class _Claim:
    """Claim *item*, ``(key, fingerprint)``, with the claims made meanwhile: answers its
    claim answer (or the `StoreError` for it). *many* claims a list (`_claim_many`)."""

    item: tuple[str, str]
    many: Callable[[list[tuple[str, str]]], Flow[list[Any]]]


@dataclass(frozen=True, slots=True, eq=False)
class _Completed:
    """Wait for the completions of these `_Complete` handles; answers theirs, in order."""

    handles: Sequence[Any]


class _Completions:
    """The completions of one `run_with`, sent from a thread of their own while the next
    handlers run: one goes at once; those queued while it is in flight go together, as one
    batch call (group commit)."""

    def __init__(self, perform: Callable[[Any], Any]) -> None:
        self._perform = perform
        self._lock = threading.Lock()
        self._queue: list[tuple[_Complete, concurrent.futures.Future[Any]]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, op: _Complete) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._queue.append((op, future))
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="oncely-complete"
                )
        self._pool.submit(self._send)
        return future

    def _send(self) -> None:
        with self._lock:
            queued, self._queue = self._queue, []
        for batch in _by_flow(queued):  # none: sent with an earlier one
            try:
                flow = batch[0][0].many([op.item for op, _ in batch])
                answers: list[Any] = drive(flow, self._perform)
            except BaseException as exc:  # answered to each waiter, as a failed batch call
                answers = [exc] * len(batch)
            for (_, future), answer in zip(batch, answers, strict=True):
                future.set_result(answer)

    def close(self) -> None:
        """Wait for the completions sent: the handlers ran, their records must say so."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _AsyncCompletions:
    """Async `_Completions` (or claims, `_Claim`): a task sends them, at most `_MAX_BATCH` in
    one call; it is never cancelled with its caller, since the handlers have run. With
    *skip_cancelled* (claims), an item whose caller was cancelled before it was sent is not
    sent: it would take a lease nobody uses."""

    def __init__(
        self, perform: Callable[[Any], Awaitable[Any]], *, skip_cancelled: bool = False
    ) -> None:
        self._perform = perform
        self._skip_cancelled = skip_cancelled
        self._queue: list[tuple[Any, asyncio.Future[Any]]] = []  # _Complete or _Claim
        self._task: asyncio.Task[None] | None = None

    def submit(self, op: _Complete | _Claim) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((op, future))
        if self._task is None:
            self._task = loop.create_task(self._send())
            _SENDING.add(self._task)  # a reference, so the task is not collected mid-flight
            self._task.add_done_callback(_SENDING.discard)
        return future

    async def _send(self) -> None:
        try:
            while self._queue:
                queued = self._queue[:_MAX_BATCH]
                del self._queue[:_MAX_BATCH]
                if self._skip_cancelled:
                    queued = [entry for entry in queued if not entry[1].done()]
                for batch in _by_flow(queued):
                    try:
                        flow = batch[0][0].many([op.item for op, _ in batch])
                        answers: list[Any] = await adrive(flow, self._perform)
                    except Exception as exc:
                        answers = [exc] * len(batch)
                    except BaseException:
                        for _, future in queued:
                            future.cancel()
                        raise
                    for (_, future), answer in zip(batch, answers, strict=True):
                        if not future.done():
                            future.set_result(answer)
        finally:
            self._task = None
            for _, future in self._queue:  # only if cancelled (the loop is closing)
                future.cancel()

    def queued(self, handle: asyncio.Future[Any]) -> bool:
        """Whether the item of *handle* is still waiting to be sent."""
        return any(future is handle for _, future in self._queue)

    def idle(self) -> asyncio.Future[Any]:
        """A future done once every item submitted so far has been sent and answered."""
        if self._task is None:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return self._task


_SENDING: set[asyncio.Future[Any]] = set()


def _direct(store: Any) -> Callable[[Any], Awaitable[Any]]:
    """How the task of an `_AsyncCompletions` performs its flows' operations: store calls
    straight, not shielded (no task each), since that task is never cancelled with a caller,
    only with its loop."""

    def perform(op: Any) -> Awaitable[Any]:
        if type(op) is _execution.StoreCall:
            call: Awaitable[Any] = getattr(store, "a" + op.verb)(*op.args, **op.kwargs)
            return call
        return _execution.aperform(op, store)

    return perform


_MAX_BATCH = 256
"""The most claims (completions) `_AsyncCompletions` sends in one call: a store answers a
batch call at once, and no other call waits long behind it."""


class _AsyncGroups:
    """The claim and the completion groups of `IdempotentConsumer.aprocess` on one event loop:
    each sends one call at a time, and the items submitted meanwhile go together in the next
    (group commit: as many round trips as the store can answer, however many deliveries)."""

    def __init__(self, store: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.store = store
        self.claims = _AsyncCompletions(self.perform, skip_cancelled=True)
        self.completions = _AsyncCompletions(self.perform)
        self.running: dict[str, asyncio.Future[None]] = {}
        """The keys of the deliveries being processed, each with a future done once it is."""

    def perform(self, op: Any) -> Awaitable[Any]:
        """Perform *op* (a store call, a heartbeat's start or stop) against the store."""
        return _execution.aperform(op, self.store)

    async def claim(self, op: _Claim) -> Any:
        """Send *op* with the claims made meanwhile; answer its claim answer. A caller
        cancelled before it was sent sends nothing; one cancelled while it is in flight waits
        for its answer and releases a lease it took, then is cancelled."""
        handle = self.claims.submit(op)
        try:
            return await asyncio.shield(handle)
        except asyncio.CancelledError:
            if self.claims.queued(handle):
                handle.cancel()  # never sent now: it would take a lease nobody uses
            elif not handle.cancelled():
                await shielded(give_back(handle, self.store, op.item[0]))
            raise

    async def complete(self, op: _Complete) -> Any:
        """Send *op* with the completions made meanwhile; answer its outcome. A caller
        cancelled meanwhile waits for it to land, then is cancelled (see `_landed`)."""
        handle = self.completions.submit(op)
        try:
            return await handle
        except asyncio.CancelledError:
            if handle.cancelled():  # by this caller, not by a closing loop: it is still sent
                await _landed([self.completions.idle()])
            raise


async def _landed(handles: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """The answers of these completions (`_Complete` handles). A caller cancelled meanwhile
    waits for them to land, then is cancelled: a consumer shutting down does not close its
    store under a completion, to leave the record in progress and the message to run again."""
    pending = [handle for handle in handles if not handle.done()]
    cancelled: asyncio.CancelledError | None = None
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError as exc:
            cancelled = exc
        pending = [handle for handle in pending if not handle.done()]
    if cancelled is not None:
        raise cancelled
    return [handle.result() for handle in handles]


_F = TypeVar("_F")


def _by_flow(queued: list[tuple[_Complete, _F]]) -> list[list[tuple[_Complete, _F]]]:
    """*queued* in batches of one flow each (one consumer's completions, with its ttl; or its
    claims, `_Claim`)."""
    batches: dict[Any, list[tuple[_Complete, _F]]] = {}
    for entry in queued:
        batches.setdefault(entry[0].many, []).append(entry)
    return list(batches.values())


def run_with(
    flow: Flow[T],
    store: SyncStore,
    handler: Callable[[Any], Any],
    broker: Callable[[BrokerOp], Any],
) -> T:
    """Run an adapter's *flow* against a sync store.

    `Handle`, `Run` and `Parallel` are performed here; other `BrokerOp` values go to *broker*;
    the rest (store calls, the handler's invocation, heartbeats, sleeps) to
    `oncely._execution.perform`, with *handler* called on the message of the enclosing `Handle`.
    """
    completions = _Completions(lambda op: _execution.perform(op, store))

    def performer(message: Any) -> Callable[[Any], Any]:
        def perform(op: Any) -> Any:
            kind = type(op)
            if kind is Run:
                return _execution.invoke_under(op.lease, handler, op.message)
            if kind is _Complete:
                return completions.submit(op)
            if kind is _Completed:
                return [handle.result() for handle in op.handles]
            if kind is _Share:
                return {}  # the flows of a Parallel run one after the other
            if kind is _Decide or kind is _Wait:
                return None
            if kind is Handle:
                flow = _observed.handling(op.flow, op.message) if _events.on else op.flow
                return drive(flow, performer(op.message))
            if kind is Parallel:
                return [drive(each, perform) for each in op.flows]
            if isinstance(op, BrokerOp):
                return broker(op)
            if kind is _execution.Invoke:
                return _execution.invoke_under(op.lease, handler, message)
            return _execution.perform(op, store)

        return perform

    try:
        return drive(flow, performer(None))
    finally:
        completions.close()


async def arun_with(
    flow: Flow[T],
    store: AsyncStore,
    handler: Callable[[Any], Awaitable[Any]],
    broker: Callable[[BrokerOp], Awaitable[Any]],
) -> T:
    """Async `run_with`: the flows of a `Parallel` run as concurrent tasks."""

    completions = _AsyncCompletions(_direct(store))
    store = _Settling(store)
    claimed: dict[str, _Slot] = {}  # keys claimed by the flows of this run, see _Share
    sharing = 0  # Parallel ops of several flows running now: their flows may share keys

    def share(keys: tuple[str, ...]) -> dict[str, _Slot]:
        slots: dict[str, _Slot] = {}
        if not sharing:  # a lone flow: no other one claims its keys here
            return slots
        for key in keys:
            slot = claimed.get(key)
            if slot is None or slot.done.done():
                slot = claimed[key] = _Slot(asyncio.get_running_loop().create_future())
            slot.flows += 1
            slot.claiming += 1
            slots[key] = slot
        return slots

    def performer(message: Any) -> Callable[[Any], Awaitable[Any]]:
        async def perform(op: Any) -> Any:
            kind = type(op)
            if kind is Run:
                return await _execution.ainvoke_under(op.lease, handler, op.message)
            if kind is _Complete:
                handle = completions.submit(op)
                if op.decided is not None:
                    handle.add_done_callback(op.decided.decide)
                return handle
            if kind is _Completed:
                return await _landed(op.handles)
            if kind is _Share:
                return share(op.keys)
            if kind is _Wait:
                await asyncio.wait((op.slot.done,), timeout=op.timeout)
                return None
            if kind is _Decide:
                for slot in op.slots:
                    slot.decide()
                return None
            if kind is Handle:
                flow = _observed.handling(op.flow, op.message) if _events.on else op.flow
                return await adrive(flow, performer(op.message))
            if kind is Parallel:
                nonlocal sharing
                several = len(op.flows) > 1
                sharing += several
                tasks = [asyncio.ensure_future(adrive(each, perform)) for each in op.flows]
                try:
                    return await asyncio.gather(*tasks)
                except BaseException:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
                finally:
                    sharing -= several
            if isinstance(op, BrokerOp):
                return await broker(op)
            if kind is _execution.Invoke:
                return await _execution.ainvoke_under(op.lease, handler, message)
            return await _execution.aperform(op, store)

        return perform

    try:
        return await adrive(flow, performer(None))
    except BaseException:
        # Cancelled (a consumer shutting down) with completions on the way, say: their
        # handlers ran, so they land before the store may be closed (see `_landed`).
        with contextlib.suppress(asyncio.CancelledError):  # what is raised is the first error
            await _landed([completions.idle()])
        raise


def mark_coroutine_function(handler: Any) -> None:
    """Make an instance whose ``__call__`` is async pass for a coroutine function.

    Clients choose how to call a callback by asking ``asyncio.iscoroutinefunction`` or
    ``inspect.iscoroutinefunction``, which answer no for such an instance: aio-pika 9.0 (on
    aiormq 6), for one, then never awaits what it returns. The markers make both answer yes
    (Python 3.12+ has `inspect.markcoroutinefunction` for the second).
    """
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        mark(handler)
    handler._is_coroutine = getattr(asyncio.coroutines, "_is_coroutine", None)
