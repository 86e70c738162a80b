"""The batch path of `IdempotentConsumer.batch_flow`: a fetched batch claimed in one call, its
handlers run under one heartbeat per lease, each completion sent as its handler returns."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from oncely import _events, _execution, _observed
from oncely._core.flow import Flow
from oncely._core.records import InProgress, LeaseLost
from oncely._log import fields, get_logger
from oncely.consumers._drivers import Overlaps, Parallel, Run, SettleHere
from oncely.consumers._grouping import Landed, Settle, encoded
from oncely.consumers._running import Running
from oncely.consumers._sharing import Decide, Later, Share, Slot, Wait, decided, withdrawn
from oncely.consumers._verdicts import (
    Action,
    Delivery,
    Reason,
    Verdict,
)
from oncely.errors import (
    ConfigurationError,
    LeaseLostError,
    StoreError,
)
from oncely.stores._batch import takes_ops
from oncely.stores._coalesce import ClaimRule

logger = get_logger(__name__)

CLAIM_CHUNK = 50
"""The keys of an unordered batch claimed per call when its driver overlaps flows (async): a
batch of 200 starts its first handlers after one claim of 50 rather than of 200."""


def blocked_verdict(consumer: Running, key: str | None) -> Verdict:
    return Verdict(Action.RETRY, Reason.BLOCKED, key, consumer._retry_delay())


def sorted_out(
    consumer: Running, deliveries: Sequence[Delivery], verdicts: list[Verdict | None]
) -> tuple[dict[str, int], dict[int, list[int]], dict[str, str]]:
    """The keys of a batch to claim: key -> index of its first copy, first copy's index -> its
    other copies' indexes, key -> fingerprint. A delivery without a usable key, or a copy with
    another payload than its first, gets its verdict in *verdicts* (dead-lettered) now."""
    firsts: dict[str, int] = {}
    copies: dict[int, list[int]] = {}
    prints: dict[str, str] = {}
    for index, delivery in enumerate(deliveries):
        try:
            key = consumer.key_for(delivery)
            fingerprint = consumer.fingerprint_for(delivery)
        except Exception as exc:
            verdicts[index] = consumer._verdict(consumer._unusable(exc))
            continue
        if key in firsts:
            if prints[key] != fingerprint:
                logger.error(
                    "message dead-lettered: key=%s was used for another payload",
                    key,
                    extra=fields(key=key, store=consumer.store, outcome="dead_lettered"),
                )
                verdicts[index] = consumer._verdict(
                    Verdict(Action.DEAD_LETTER, Reason.MISMATCH, key)
                )
            else:
                copies[firsts[key]].append(index)
            continue
        firsts[key], prints[key], copies[index] = index, fingerprint, []
    return firsts, copies, prints


def batched(
    consumer: Running,
    deliveries: Sequence[Delivery],
    ordered: bool,
    held: MutableMapping[str, _execution.Lease],
) -> Flow[list[Verdict]]:
    verdicts: list[Verdict | None] = [None] * len(deliveries)
    firsts, copies, prints = sorted_out(consumer, deliveries, verdicts)
    policy = consumer._policy
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
                    extra=fields(key=key, store=consumer.store, outcome="store_unavailable"),
                )
                delay = consumer._retry_delay()
                verdicts[index] = consumer._verdict(
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
                        key=key, token=kept.token, store=consumer.store, outcome="lease_lost"
                    ),
                )
                claims[key] = index
            else:
                leases.append((index, kept))
        overlapping = not ordered and not kept_leases and len(claims) > CLAIM_CHUNK
        if overlapping and (yield Overlaps()):
            # Claimed in chunks sent at once: the first chunk's handlers run while the
            # store answers the next ones. Copies of a key are in one chunk (see *copies*).
            chunks = list(claims.items())
            parts = [
                _claim_and_run(
                    consumer, deliveries, dict(chunks[at : at + CLAIM_CHUNK]), prints, [], verdicts
                )
                for at in range(0, len(chunks), CLAIM_CHUNK)
            ]
            yield Parallel(parts, shares=False)
        else:
            yield from _claim_and_run(
                consumer, deliveries, claims, prints, leases, verdicts, ordered, held
            )
    return copies_decided(consumer, copies, verdicts)


def copies_decided(
    consumer: Running, copies: dict[int, list[int]], verdicts: list[Verdict | None]
) -> list[Verdict]:
    """Every verdict of the batch, once its first copies are decided: the other copies of a
    key acked as duplicates of its first copy's run, or redelivered when it was not acked."""
    for first, others in copies.items():
        outcome = verdicts[first]
        assert outcome is not None
        for index in others:
            if outcome.action is Action.ACK:
                logger.info(
                    "duplicate suppressed key=%s status=in_batch",
                    outcome.key,
                    extra=fields(key=outcome.key, store=consumer.store, outcome="in_batch"),
                )
                copy = Verdict(Action.ACK, Reason.DUPLICATE, outcome.key, result=outcome.result)
            else:  # redelivered: a later claim decides it (never dead-lettered twice here)
                copy = Verdict(
                    Action.RETRY, Reason.IN_PROGRESS, outcome.key, consumer._retry_delay()
                )
            verdicts[index] = consumer._verdict(copy)
    settled = [verdict for verdict in verdicts if verdict is not None]
    assert len(settled) == len(verdicts)
    return settled


def _claim_and_run(
    consumer: Running,
    deliveries: Sequence[Delivery],
    claims: dict[str, int],
    prints: Mapping[str, str],
    leases: list[tuple[int, _execution.Lease]],
    verdicts: list[Verdict | None],
    ordered: bool = False,
    held: MutableMapping[str, _execution.Lease] | None = None,
) -> Flow[None]:
    """Claim *claims* (key -> index of its first copy) in one call and run the handlers of
    those acquired, and of *leases* (kept from an earlier round); set their *verdicts*."""
    requests = [(key, prints[key]) for key in claims]
    answers: list[Any] = []
    slots: dict[str, Slot] = {}
    if requests:
        slots = yield Share(tuple(claims))
        answers = yield from consumer._claim_many(requests)
    runs: list[tuple[int, _execution.Lease | Later]] = [*leases]
    for (key, index), answer in zip(claims.items(), answers, strict=True):
        slot = slots.get(key)
        if slot is not None:
            slot.claiming -= 1
            if isinstance(answer, InProgress) and slot.flows > 1:
                # Maybe claimed by another flow of this run (another partition's
                # copy): run under its lease if it has not started, else wait for it.
                runs.append((index, Later(key, prints[key], slot)))
                continue
        verdict, lease = consumer._claimed(key, answer)
        if verdict is None:
            assert lease is not None
            if slot is not None:
                slot.owned, slot.fingerprint = True, prints[key]
            runs.append((index, lease))
            continue
        if lease is not None:  # exhausted: given back, not run
            yield from consumer._release(lease)
        verdicts[index] = consumer._verdict(verdict)
    idle = [slot for slot in slots.values() if not slot.claiming and not slot.owned]
    if idle:  # nobody here got these keys: their other copies need not wait
        yield Decide(idle)
    runs.sort(key=lambda pair: pair[0])
    if ordered:  # leases after the first retry are kept for next time, unused
        assert held is not None
        stop = min(
            (i for i, v in enumerate(verdicts) if v and v.action is Action.RETRY),
            default=len(deliveries),
        )
        for index, run in runs:
            if index > stop:
                if isinstance(run, _execution.Lease):
                    held[run.key] = run
                verdicts[index] = consumer._verdict(blocked_verdict(consumer, run.key))
        runs = [(i, run) for i, run in runs if i < stop]
    ran = yield from _run_batch(consumer, deliveries, runs, slots, held if ordered else None)
    for index, verdict in ran:
        verdicts[index] = consumer._verdict(verdict)
    if slots:
        yield Decide(list(slots.values()))


def claim_many(consumer: Running, requests: list[tuple[str, str]]) -> Flow[list[Any]]:
    """Claim every request in one call, by the rule of the one grouping of claims
    (`oncely.stores._coalesce.ClaimRule`): a call whose outcome is unknown (it timed out, or
    its connection broke) is sent once more to learn each item's, with the same call ids when
    the store takes them (``ops``): a claim applied with its reply lost then answers
    `Acquired`. Without ids, an item answered `InProgress` may hold its own first claim and
    keeps the error (never run: its lease, if it is ours, expires on its own); the others
    get their answers."""
    options: dict[str, Any] = {"lease": consumer._policy.lease, "ttl": consumer._policy.ttl}
    if consumer._takes_ops is None:  # both twins: a subclass may override one without ids
        verbs = (getattr(consumer.store, name, None) for name in ("claim_many", "aclaim_many"))
        consumer._takes_ops = all(takes_ops(verb) for verb in verbs if verb is not None)
    rule = _BatchClaims()
    rule.takes_ops = consumer._takes_ops
    items: list[tuple[str, str, str | None]]
    if rule.takes_ops:  # the same ids if sent again; unique: a random prefix per call
        prefix = secrets.token_hex(8)
        items = [(key, fp, f"{prefix}.{i}") for i, (key, fp) in enumerate(requests)]
    else:
        items = [(key, fp, None) for key, fp in requests]
    try:
        answers = yield from rule.answers(items, options)
    except StoreError as exc:
        answers = [exc] * len(requests)
    errors = [answer for answer in answers if isinstance(answer, StoreError)]
    if errors:
        logger.warning(
            "store error claiming a batch; redelivering later: %s",
            errors[0],
            extra=fields(store=consumer.store, outcome="store_unavailable"),
        )
    return answers


class _BatchClaims(ClaimRule):
    """`ClaimRule` in a consumer's flow: its batch call is a `oncely._execution.StoreCall`."""

    def __init__(self) -> None:
        super().__init__(None, None)

    def _many_call(self, items: list[tuple[Any, ...]], options: dict[str, Any]) -> Any:
        many = super()._many_call(items, options)
        return _execution.StoreCall("claim_many", many.args, many.kwargs)


def _run_batch(
    consumer: Running,
    deliveries: Sequence[Delivery],
    runs: list[tuple[int, _execution.Lease | Later]],
    slots: Mapping[str, Slot],
    held: MutableMapping[str, _execution.Lease] | None,
) -> Flow[list[tuple[int, Verdict]]]:
    """Run the handlers of the acquired leases, each completed as soon as it returns.

    A completion goes to the store at once, while the next handlers run, and those that
    finish meanwhile go together as one batch call (`Settle`): a worker killed in one
    handler leaves the earlier ones completed, never to run again. Ordered batches (*held*
    given) run their handlers one after the other and stop at the first one to retry;
    others run them as a `Parallel` (concurrently when async).

    A lease whose key another flow of the same run also has (*slots*, `Later`) is run by
    whichever of the two reaches it first; the other waits for that run.
    """
    policy = consumer._policy
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
            # Async, each run is a task of its own whose last step is its completion: awaited
            # there (`SettleHere`), with no task of its own. Sync, it goes to the group commit.
            here = bool(runs) and bool((yield Overlaps()))
            starts = [
                _start(consumer, deliveries[i].raw, run, slots, acquired, here) for i, run in runs
            ]
            outcomes_of_runs = yield Parallel(starts, shares=False)  # they claim no keys
        else:
            outcomes_of_runs = []
            blocked = False
            for position, (index, run) in enumerate(runs):
                if blocked:
                    if withdrawn(run, slots):  # ours, not started: for the next round
                        held[run.key] = run
                        yield from decided(slots.get(run.key))
                    outcomes_of_runs.append(None)
                    continue
                try:
                    ran = yield from _start(consumer, deliveries[index].raw, run, slots, acquired)
                except BaseException:
                    for _, left in runs[position + 1 :]:
                        if withdrawn(left, slots):
                            yield from consumer._release(left)
                    raise
                blocked = isinstance(ran, Verdict) and ran.action is Action.RETRY
                outcomes_of_runs.append(ran)
        for (index, run), ran in zip(runs, outcomes_of_runs, strict=True):
            if ran is None:
                verdicts.append((index, blocked_verdict(consumer, run.key)))
            elif isinstance(ran, Verdict):
                verdicts.append((index, ran))
            else:
                finished.append((index, *ran))
        outcomes: list[Any] = []
        if finished:
            outcomes = yield Landed([sent for *_, sent in finished])
    finally:
        for lease in leases:
            withdrawn(lease, slots)  # an error: nobody starts it now
        taken = {id(slot.taken) for slot in slots.values() if slot.taken is not None}
        for lease in [*(lease for lease in leases if id(lease) not in taken), *acquired]:
            if lease.heartbeat is not None:
                yield _execution.StopHeartbeat(lease)
    for (index, lease, value, _), outcome in zip(finished, outcomes, strict=True):
        verdicts.append((index, settled_verdict(consumer, lease, value, outcome)))
    return verdicts


def _start(
    consumer: Running,
    message: Any,
    run: _execution.Lease | Later,
    slots: Mapping[str, Slot],
    acquired: list[_execution.Lease],
    here: bool = False,
) -> Flow[tuple[_execution.Lease, Any, Any] | Verdict]:
    """Run *message* under its lease (`_run_one`), unless another flow of the run has
    started it: then it is a copy of that run (`_later`). *here*: see `_run_one`."""
    if isinstance(run, Later):
        return (yield from _later(consumer, message, run, acquired, here))
    slot = slots.get(run.key)
    if slot is not None:
        if slot.lease is not run:  # another flow took it: this delivery is its copy
            assert slot.fingerprint is not None
            later = Later(run.key, slot.fingerprint, slot)
            return (yield from _later(consumer, message, later, acquired, here))
        slot.lease = None
    return (yield from _run_one(consumer, message, run, slot, here))


def _later(
    consumer: Running,
    message: Any,
    later: Later,
    acquired: list[_execution.Lease],
    here: bool = False,
) -> Flow[tuple[_execution.Lease, Any, Any] | Verdict]:
    """A copy of a key another flow of this run claimed: run under that flow's lease if it
    has not started it (same fingerprint), else wait for that run (`retry_delay` at most)
    and claim: a completed duplicate then, mostly. The store decides, as ever."""
    slot = later.slot
    if slot.lease is None:
        yield Wait(slot, consumer.policy.retry_delay.total_seconds())
    lease = slot.lease
    if lease is not None and slot.fingerprint == later.fingerprint:
        slot.lease, slot.taken = None, lease
        acquired.append(lease)
        return (yield from _run_one(consumer, message, lease, slot, here))
    answers = yield from consumer._claim_many([(later.key, later.fingerprint)])
    verdict, lease = consumer._claimed(later.key, answers[0])
    if verdict is not None:
        if lease is not None:  # exhausted: given back, not run
            yield from consumer._release(lease)
        return verdict
    assert lease is not None
    acquired.append(lease)
    if consumer._policy.heartbeat:
        yield _execution.StartHeartbeat(lease)
    return (yield from _run_one(consumer, message, lease, None, here))


def settled_verdict(
    consumer: Running, lease: _execution.Lease, value: Any, outcome: Any
) -> Verdict:
    """The verdict of a handler that returned *value*, once its completion answered
    *outcome* (`Landed`): acked only when the record is completed."""
    key = lease.key
    if outcome is None:
        return Verdict(Action.ACK, Reason.PROCESSED, key, attempt=lease.attempt, result=value)
    if isinstance(outcome, LeaseLost):
        lease.lost = True
        logger.error(
            "lease lost key=%s token=%d on complete",
            key,
            lease.token,
            extra=fields(key=key, token=lease.token, store=consumer.store, outcome="lease_lost"),
        )
        return Verdict(Action.RETRY, Reason.LEASE_LOST, key, consumer._retry_delay())
    if isinstance(outcome, LeaseLostError):  # logged by the settle flow
        return Verdict(Action.RETRY, Reason.LEASE_LOST, key, consumer._retry_delay(), error=outcome)
    # an error for this item alone, or for the whole call
    return Verdict(
        Action.RETRY, Reason.STORE_UNAVAILABLE, key, consumer._retry_delay(), error=outcome
    )


def _run_one(
    consumer: Running,
    message: Any,
    lease: _execution.Lease,
    slot: Slot | None = None,
    here: bool = False,
) -> Flow[tuple[_execution.Lease, Any, Any] | Verdict]:
    """Run one handler and send its completion off at once: ``(lease, value, handle)``
    (the handle answers the completion, see `Landed`), or the verdict of its failure.
    *slot* (the key's, shared with other flows) is decided once the completion lands.
    *here*: this flow is a task of its own with nothing left to do: the completion is
    awaited in it (`SettleHere`), its handle done when returned."""
    ran = yield from _guarded(consumer, message, lease)
    if isinstance(ran, Verdict):
        yield from decided(slot)
        return ran
    if lease.committed:  # completed in the handler's own transaction (Inbox.transactional)
        yield from decided(slot)
        return settled_verdict(consumer, lease, ran[0], None)
    lease.settling = True  # an extend landing after the completion answers LeaseLost
    if lease.heartbeat is not None:  # before the completion: an extend after it is refused
        yield _execution.StopHeartbeat(lease)
    settle = Settle(consumer, lease, encoded(lease, ran[0], consumer.codec), slot)
    sent = yield (SettleHere(settle) if here else settle)
    return lease, ran[0], sent


def _guarded(
    consumer: Running, message: Any, lease: _execution.Lease
) -> Flow[tuple[Any] | Verdict]:
    """Run one handler: ``(value,)``, or the verdict of its failure (lease released).

    Observed, the run's start and end are kept for the delivery's report (`_observed.verdict`):
    the batch is decided after every handler ran, and each delivery is timed by its own."""
    started = time.time_ns() if _events.on else 0
    try:
        try:
            value = yield Run(message, lease)
        finally:
            if started:
                _observed.ran(consumer, lease.key, started)
    except ConfigurationError:
        yield from consumer._release(lease)  # not the message's failure: never redelivered as one
        raise
    except Exception as exc:
        verdict = consumer._failed(lease.key, lease.attempt, exc)
        yield from consumer._settle_failure(lease, verdict, exc)
        return verdict
    except BaseException:  # cancelled: give the lease back, then go on being cancelled
        yield from consumer._release(lease)
        raise
    return (value,)
