"""What the entry points call to report to `oncely._events`, only while something subscribes.

Each entry point checks `oncely._events.on` and, when it is set, hands the operation to one of
these functions: they time it, learn its outcome (from the claim answers `oncely._execution`
reports, or from the entry point's own answer) and emit the events. Nothing here runs in an
unobserved process.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from oncely import _events
from oncely._core.flow import Flow
from oncely._core.records import Acquired, Replay
from oncely.errors import (
    FingerprintMismatchError,
    InProgressError,
    InvalidKeyError,
)

T = TypeVar("T")

__all__ = [
    "Observation",
    "asgi",
    "beat",
    "beat_answered",
    "consuming",
    "django",
    "claimed",
    "entering",
    "exited",
    "handling",
    "lease_lost",
    "observing",
    "operation_of",
    "outbox_headers",
    "perform",
    "process",
    "aprocess",
    "backlog",
    "refused",
    "relayed",
    "sending",
    "serving",
    "store_name",
    "timed",
    "verdict",
    "wsgi",
]

_current: contextvars.ContextVar[Observation | None] = contextvars.ContextVar(
    "oncely_observation", default=None
)

_VERBS = frozenset(
    {"claim", "complete", "fail", "release", "extend", "get", "claim_many", "complete_many"}
)


def operation_of(key: str) -> str:
    """The bounded name of *key*'s operation: its scope, without an HTTP principal's digest."""
    scope = key.partition("|")[0]
    return scope.partition(" @")[0]


def store_name(store: Any) -> str:
    """A store's backend name (``memory``, ``sqlite``, ``postgres``, ``redis``, ``tiered``...),
    looking through the wrappers entry points put around it."""
    for _ in range(4):
        inner = getattr(store, "store", None)
        if inner is None or inner is store:
            break
        store = inner
    backend = getattr(store, "backend", None)
    return backend if isinstance(backend, str) else type(store).__name__


def error_outcome(exc: BaseException | None) -> _events.Outcome:
    """The outcome of an operation that ended with *exc* before any claim answered."""
    if isinstance(exc, InProgressError):
        return "in_progress"
    if isinstance(exc, FingerprintMismatchError):
        return "mismatch"
    if isinstance(exc, InvalidKeyError):
        return "refused"
    return "error"


class Observation:
    """One operation being observed: when it started and what its claims answered."""

    __slots__ = (
        "attempt",
        "detail",
        "handle",
        "operation",
        "outcome",
        "started",
        "store",
        "surface",
        "token",
    )

    def __init__(self, surface: _events.Surface, operation: str, store: str) -> None:
        self.surface: _events.Surface = surface
        self.operation = operation
        self.store = store
        self.outcome: _events.Outcome | None = None
        self.token: int | None = None
        self.attempt = 0
        self.detail: str | None = None
        self.handle = _events.Handle()
        self.started = time.perf_counter()

    def start(
        self,
        destination: str | None = None,
        headers: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> None:
        """Report the start (exporters open their span: it is current while the operation runs);
        *start_ns* for an operation reported after the fact."""
        started = _events.Started(
            self.surface,
            self.operation,
            self.store,
            self.handle,
            destination,
            headers or {},
            start_ns,
        )
        _events.emit(started)

    def claimed(
        self, outcome: _events.Outcome, key: str, token: int | None, attempt: int = 0
    ) -> None:
        """Record a claim's answer (a later one replaces an ``in_progress`` waited on)."""
        if self.outcome is None or self.outcome == "in_progress":
            self.outcome = outcome
            self.operation = operation_of(key)
            self.token = token
            self.attempt = attempt

    def finish(
        self,
        error: BaseException | None = None,
        *,
        timed: bool = True,
        ran_ns: tuple[int, int] | None = None,
    ) -> None:
        """Report the operation, once: timed from `started` to now, not timed, or (*ran_ns*)
        over its own run's start and end, reported after the fact."""
        outcome = self.outcome if self.outcome is not None else error_outcome(error)
        if ran_ns is not None:
            duration: float | None = (ran_ns[1] - ran_ns[0]) / 1e9
        else:
            duration = time.perf_counter() - self.started if timed else None
        _events.emit(
            _events.Operation(
                self.surface,
                self.operation,
                self.store,
                outcome,
                duration,
                self.token,
                self.attempt,
                None if error is None else type(error).__name__,
                self.detail,
                self.handle,
                None if ran_ns is None else ran_ns[1],
            )
        )


# -- what oncely._execution reports -----------------------------------------------------------


def claimed(key: str, answer: Any) -> None:
    """A claim of *key* answered *answer* (`Acquired`, `Replay`, or the name of an outcome)."""
    observation = _current.get()
    if observation is None:
        return
    if type(answer) is Acquired:
        outcome: _events.Outcome = "recovered" if answer.recovered else "acquired"
        observation.claimed(outcome, key, answer.token, answer.attempt)
    elif type(answer) is Replay:
        observation.claimed("replayed", key, answer.record.token)
    else:
        observation.claimed(answer, key, None)


def lease_lost(key: str, token: int, during: str) -> None:
    """The lease of *key* was found taken over (by a heartbeat, or when settling)."""
    _events.emit(_events.LeaseLost(operation_of(key), token, during))


def beat(key: str, token: int, ok: bool) -> None:
    """A heartbeat extended the lease of *key*, or failed to."""
    _events.emit(_events.Heartbeat(operation_of(key), token, ok))


def beat_answered(key: str, token: int, answer: Any, settling: bool) -> None:
    """An extend answered *answer* (``None``: extended; `LeaseLost`, unless already settling)."""
    if answer is None:
        beat(key, token, True)
    elif not settling:
        lease_lost(key, token, "heartbeat")


# -- store calls ------------------------------------------------------------------------------


class TimedStore:
    """A store whose verbs report their latency and errors; everything else passes through."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.name = store_name(store)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.store, name)
        if not callable(attribute):
            return attribute
        verb = name[1:] if name.startswith("a") and name[1:] in _VERBS else name
        if verb not in _VERBS:
            return attribute
        if verb is name:
            timed_call = _timed(self.name, verb, attribute)
        else:
            timed_call = _atimed(self.name, verb, attribute)
        self.__dict__[name] = timed_call  # found directly from now on
        return timed_call


def _timed(store: str, verb: str, call: Callable[..., T]) -> Callable[..., T]:
    def timed_call(*args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            answer = call(*args, **kwargs)
        except Exception as exc:
            _store_call(store, verb, started, exc)
            raise
        _store_call(store, verb, started, None)
        return answer

    return timed_call


def _atimed(store: str, verb: str, call: Callable[..., Awaitable[T]]) -> Callable[..., Any]:
    async def timed_call(*args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            answer = await call(*args, **kwargs)
        except Exception as exc:
            _store_call(store, verb, started, exc)
            raise
        _store_call(store, verb, started, None)
        return answer

    return timed_call


def _store_call(store: str, verb: str, started: float, error: BaseException | None) -> None:
    if _events.on:
        duration = time.perf_counter() - started
        failure = None if error is None else type(error).__name__
        _events.emit(_events.StoreCall(store, verb, duration, failure))


def timed(store: T) -> T:
    """*store* with its verbs timed (itself if it is timed already)."""
    if type(store) is TimedStore:
        return store
    return TimedStore(store)  # type: ignore[return-value]


def perform(op: Any, store: Any) -> Any:
    """Perform a flow's store call, timed."""
    return getattr(timed(store), op.verb)(*op.args, **op.kwargs)


# -- the decorator ----------------------------------------------------------------------------


@contextlib.contextmanager
def observing(surface: _events.Surface, operation: str, store: Any) -> Iterator[Observation]:
    """Observe the block as one operation of *surface* (a decorated call): the claims its flows
    make report to it, and it is reported when the block ends, with the error it raised."""
    observation = Observation(surface, operation, store_name(store))
    reset = _current.set(observation)
    try:
        observation.start()
        try:
            yield observation
        except BaseException as exc:
            observation.finish(exc)
            raise
        observation.finish()
    finally:
        _current.reset(reset)


# -- context managers: Guard and the inbox's entries ------------------------------------------


def entering(owner: Any, flow: Flow[T], surface: _events.Surface, key: str, store: Any) -> Flow[T]:
    """*flow* (the claim of a ``with`` block) observed: an answer that does not run the block is
    reported at once; one that does is reported when the block exits (see `exited`)."""
    observation = Observation(surface, operation_of(key), store_name(store))
    observation.start()
    try:
        answer = yield from flow
    except BaseException as exc:
        observation.finish(exc)
        raise
    if isinstance(answer, Replay):
        observation.claimed("replayed", key, answer.record.token)
        observation.finish()
        return answer
    recovered = bool(getattr(answer, "recovered", False))
    token, attempt = getattr(answer, "token", None), getattr(answer, "attempt", 0)
    observation.claimed("recovered" if recovered else "acquired", key, token, attempt)
    owner._oncely_observation = observation
    return answer


def exited(owner: Any, error: BaseException | None) -> None:
    """The block of an observed ``with`` ended (with *error*): report its operation."""
    observation: Observation | None = owner.__dict__.pop("_oncely_observation", None)
    if observation is not None:
        observation.finish(error)


# -- HTTP -------------------------------------------------------------------------------------

_serving: contextvars.ContextVar[bool] = contextvars.ContextVar("oncely_serving", default=False)


def serving() -> bool:
    """Whether this request is already observed (the middleware is re-entered by `asgi`)."""
    return _serving.get()


def refused() -> None:
    """The request was turned away before any claim (a missing or invalid key, too large)."""
    observation = _current.get()
    if observation is not None and observation.surface == "http":
        observation.outcome = "refused"


async def asgi(middleware: Any, scope: Any, receive: Any, send: Any) -> None:
    """One ASGI request through *middleware*, observed: reported if oncely answered or ran it."""
    observation = Observation("http", "", store_name(getattr(middleware, "store", None)))
    reset = _current.set(observation)
    serving_reset = _serving.set(True)

    async def observed_send(message: Any) -> None:
        if message["type"] == "http.response.start" and observation.detail is None:
            observation.detail = str(message["status"])
        await send(message)

    error: BaseException | None = None
    try:
        await middleware(scope, receive, observed_send)
    except BaseException as exc:
        error = exc
        raise
    finally:
        _serving.reset(serving_reset)
        _current.reset(reset)
        if observation.outcome is not None or _store_failed(observation):
            observation.finish(error)


def wsgi(middleware: Any, environ: Any, start_response: Any) -> Any:
    """One WSGI request through *middleware*, observed (see `asgi`); the operation ends when
    the middleware returns its response body."""
    observation = Observation("http", "", store_name(getattr(middleware, "store", None)))
    reset = _current.set(observation)
    serving_reset = _serving.set(True)

    def observed_start(status: str, headers: Any, *exc_info: Any) -> Any:
        if observation.detail is None:
            observation.detail = status.partition(" ")[0]
        return start_response(status, headers, *exc_info)

    error: BaseException | None = None
    try:
        return middleware(environ, observed_start)
    except BaseException as exc:
        error = exc
        raise
    finally:
        _serving.reset(serving_reset)
        _current.reset(reset)
        if observation.outcome is not None or _store_failed(observation):
            observation.finish(error)


def django(middleware: Any, request: Any) -> Any:
    """One Django request through *middleware*, observed (see `asgi`); in an async stack,
    the coroutine that handles it."""
    observation = Observation("http", "", store_name(getattr(middleware, "store", None)))
    if middleware.async_mode:
        return _adjango(middleware, request, observation)
    with _django_request(observation):
        response = middleware(request)
        observation.detail = str(getattr(response, "status_code", "")) or None
        return response


async def _adjango(middleware: Any, request: Any, observation: Observation) -> Any:
    with _django_request(observation):
        response = await middleware(request)
        observation.detail = str(getattr(response, "status_code", "")) or None
        return response


@contextlib.contextmanager
def _django_request(observation: Observation) -> Iterator[None]:
    """The block serves one Django request under *observation*, reported at its end if a claim
    (or a store call that failed) gave it an outcome."""
    reset = _current.set(observation)
    serving_reset = _serving.set(True)
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        _serving.reset(serving_reset)
        _current.reset(reset)
        if observation.outcome is not None or _store_failed(observation):
            observation.finish(error)


def sending(flow: Flow[T], request: Any, replay_header: str = "idempotent-replayed") -> Flow[T]:
    """The retry flow of an httpx transport's request, observed: one ``client`` operation,
    its outcome read from the server's answer (a replay, 409 in progress, 422 mismatch)."""
    operation = f"{request.method} {request.url.host}"
    observation = Observation("client", operation, "none")
    observation.start()
    try:
        response: Any = yield from _counting(flow, observation)
    except BaseException as exc:
        observation.finish(exc)
        raise
    status = response.status_code
    observation.detail = str(status)
    if response.headers.get(replay_header) is not None:
        observation.outcome = "replayed"
    elif status == 409:
        observation.outcome = "in_progress"
    elif status == 422:
        observation.outcome = "mismatch"
    elif status >= 500 or status == 429:
        observation.outcome = "error"
    else:
        observation.outcome = "acquired"
    observation.finish()
    return response  # type: ignore[no-any-return]


def _counting(flow: Flow[T], observation: Observation) -> Flow[T]:
    """*flow*, counting the attempts it sends into *observation*."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.throw(error) if error is not None else flow.send(send)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if type(op).__name__ == "SendOp":
            observation.attempt += 1
        try:
            send, error = (yield op), None
        except BaseException as exc:
            send, error = None, exc


def _store_failed(observation: Observation) -> bool:
    if observation.detail == "503":  # the store failed, and oncely answered
        observation.outcome = "error"
        return True
    return False


# -- consumers --------------------------------------------------------------------------------


_consuming: contextvars.ContextVar[bool] = contextvars.ContextVar("oncely_consuming", default=False)


def consuming() -> bool:
    """Whether this delivery is already observed (`process` re-enters the consumer)."""
    return _consuming.get()


def process(consumer: Any, delivery: Any, handler: Any) -> Any:
    """`IdempotentConsumer.process` of one delivery, observed: timed, its verdict reported."""
    with _delivery(consumer, delivery) as observation:
        decided = consumer.process(delivery, handler)
    return _decided(observation, decided)


async def aprocess(consumer: Any, delivery: Any, handler: Any) -> Any:
    """`IdempotentConsumer.aprocess`, observed (see `process`)."""
    with _delivery(consumer, delivery) as observation:
        decided = await consumer.aprocess(delivery, handler)
    return _decided(observation, decided)


@contextlib.contextmanager
def _delivery(consumer: Any, delivery: Any) -> Iterator[Observation]:
    """The block processes one delivery under a fresh observation (reported if it raises)."""
    observation = _delivery_observation(consumer, delivery)
    reset, consuming_reset = _current.set(observation), _consuming.set(True)
    try:
        yield observation
    except BaseException as exc:
        observation.finish(exc)
        raise
    finally:
        _consuming.reset(consuming_reset)
        _current.reset(reset)


def _decided(observation: Observation, decided: Any) -> Any:
    if observation.detail is not None:  # its verdict was reported into it
        observation.finish(decided.error)
    return decided


def _delivery_observation(consumer: Any, delivery: Any) -> Observation:
    observation = Observation("consumer", consumer.scope, store_name(consumer.store))
    observation.start(_destination(delivery.raw), delivery.headers)
    return observation


def handling(flow: Flow[T], message: Any, consumer_store: Any = None) -> Flow[T]:
    """One delivery's flow (a `Handle`), observed: timed, its verdict reported by `verdict`."""
    observation = Observation("consumer", "", store_name(consumer_store))
    observation.start(_destination(message))
    reset = _current.set(observation)
    try:
        return (yield from flow)
    finally:
        with contextlib.suppress(ValueError):  # ended in another context: it ends with it
            _current.reset(reset)
        if observation.detail is not None:  # its verdict was reported into it
            observation.finish(None)


_REASON_OUTCOMES: Mapping[str, _events.Outcome] = {
    "duplicate": "replayed",
    "in_progress": "in_progress",
    "mismatch": "mismatch",
    "invalid_key": "refused",
    "corrupt_record": "error",
    "store_unavailable": "error",
}


def verdict(consumer: Any, decided: Any) -> None:
    """A consumer reached *decided* (its `Verdict`) for one delivery."""
    scope = consumer.scope
    action, reason = decided.action.value, decided.reason.value
    _events.emit(_events.Verdict(scope, action, reason))
    if action == "dead_letter":
        _events.emit(_events.DeadLetter("consumer", scope, reason))
    if reason == "blocked":  # not decided for itself: retried after an earlier message
        return
    outcome = _REASON_OUTCOMES.get(reason, "acquired")
    observation = _current.get()
    # The delivery's own observation (`process`, `handling`) until its verdict is in; a
    # batch's deliveries are decided together, each reported here.
    timed_here = (
        observation is not None and observation.surface == "consumer" and observation.detail is None
    )
    if observation is None or not timed_here:
        observation = Observation("consumer", scope, store_name(consumer.store))
    observation.operation = scope
    observation.store = store_name(consumer.store)
    observation.outcome = outcome
    observation.attempt = decided.attempt
    observation.detail = reason
    if not timed_here:  # decided in a batch: spanned and timed by its handler's run, if any
        ran_ns = consumer._ran_ns.pop(decided.key, None)
        observation.start(start_ns=None if ran_ns is None else ran_ns[0])
        observation.finish(decided.error, timed=False, ran_ns=ran_ns)


_MAX_RUNS_KEPT = 4096


def ran(consumer: Any, key: str, started_ns: int) -> None:
    """A batch's handler for *key* ran from *started_ns* to now: kept for its `verdict`."""
    runs: dict[str, tuple[int, int]] = consumer._ran_ns
    if len(runs) >= _MAX_RUNS_KEPT:  # runs whose verdict never came (a cancelled batch)
        runs.clear()
    runs[key] = (started_ns, time.time_ns())


def _destination(message: Any) -> str | None:
    """The queue, topic, subject or stream a broker's message came from, where it says."""
    for name in ("routing_key", "topic", "subject", "stream", "queue"):
        value = getattr(message, name, None)
        if callable(value):
            try:
                value = value()
            except Exception:
                value = None
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str) and value:
            return value
    return None


# -- the outbox -------------------------------------------------------------------------------


def outbox_headers(destination: str, headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """Report an event written to the outbox; return its headers with the writer's trace
    context (``traceparent``) added when an exporter propagates one."""
    _events.emit(_events.OutboxWritten(destination))
    carrier: dict[str, str] = {}
    for inject in _events.injectors:
        inject(carrier)
    if not carrier:
        return headers
    given = dict(headers or {})
    lowered = {name.lower() for name in given}
    for name, value in carrier.items():
        if name.lower() not in lowered:
            given[name] = value
    return given


def relayed(events: Sequence[Any], outcomes: Sequence[Any], max_attempts: int) -> None:
    """The relay learned the publish outcomes of a batch: report each published or failed
    event (those not attempted are not), and the ones dead-lettered."""
    for event, outcome in zip(events, outcomes, strict=False):
        if outcome is not None and not isinstance(outcome, BaseException):
            continue  # not attempted: published later
        error = None if outcome is None else type(outcome).__name__
        attempts = event.attempts + 1
        _events.emit(
            _events.OutboxPublished(event.destination, attempts, error, dict(event.headers))
        )
        if error is not None and attempts >= max_attempts:
            _events.emit(_events.DeadLetter("outbox", event.destination, error))


BACKLOG_INTERVAL = 5.0
"""Seconds between two backlog counts of one relay (a count reads the whole outbox)."""


async def backlog(backend: Any) -> None:
    """Report the outbox's backlog after a relay cycle (one count query, at most every
    `BACKLOG_INTERVAL`); a failed count is left to the next cycle."""
    now = time.monotonic()
    if now < getattr(backend, "_oncely_backlog_at", 0.0):
        return
    backend._oncely_backlog_at = now + BACKLOG_INTERVAL
    try:
        counts = await backend.stats()
    except Exception:
        return
    oldest = counts.get("oldest_pending")
    age = None
    if oldest is not None:
        from datetime import datetime

        moment = oldest if isinstance(oldest, datetime) else _parse(str(oldest))
        age = max(time.time() - moment.timestamp(), 0.0)
    _events.emit(_events.OutboxBacklog(int(counts["pending"]), int(counts["dead"]), age))


def _parse(text: str) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00"))
