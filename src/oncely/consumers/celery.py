"""An idempotent Celery task option: each task message takes effect once (late acks).

.. code-block:: python

    from oncely.consumers.celery import IdempotentTask

    @app.task(base=IdempotentTask, oncely_store=store)
    def charge(order_id: str, amount_cents: int) -> str:
        return bank.charge(order_id, amount_cents)

    charge.apply_async(("o-1", 500), **celery_options(request_key))

`IdempotentTask` sets ``acks_late = True`` and ``reject_on_worker_lost = True``: the message is
acknowledged only after the task returned, and a worker process killed mid-task leaves it to
be delivered again. It also sets ``max_retries = None``: the attempts that count are the
record's (`ConsumerPolicy.max_attempts`), which survive redelivery to other workers.

Every option below can be given to ``@app.task(...)``:

* ``oncely_store``: the `oncely.SyncStore` keeping the records (required);
* ``oncely_group``: the scope of the keys (default: ``celery:<task name>``);
* ``oncely_policy``: an `oncely.consumers.ConsumerPolicy`;
* ``oncely_key``: ``"header"`` (default: the ``Idempotency-Key`` header, else the task id),
  ``"content"`` (a hash of the arguments) or a callable over the `oncely.consumers.Delivery`
  (whose ``raw`` is the task's request);
* ``oncely_fingerprint``: ``"body"`` (default: the canonical arguments), ``None`` or a callable;
* ``oncely_dead_letter_queue``: a queue that receives a copy of each dead-lettered task.

The key or fingerprint made from the arguments is their canonical JSON (the same in every
process and on every redelivery): arguments without one (objects a pickle serializer carries)
are refused by ``apply_async`` with `oncely.errors.FingerprintError`, and such a message sent
another way is dead-lettered; with ``oncely_fingerprint=None`` or a callable (and a key that is
not ``"content"``) they are allowed, and the `oncely.consumers.Delivery` body is empty.

How the runner's verdicts (docs/guides/consumers.md) become Celery's:

* ack: the task returns (Celery acks). A completed duplicate returns the first run's stored
  result without running;
* retry: ``self.retry(countdown=...)``: Celery publishes the task again (same id, so same key)
  and acks this delivery. A handler that raised is retried after the policy's ``retry_delay``;
  attempts are counted in the record, not in Celery's ``max_retries``;
* dead-letter: the decision is recorded (a redelivered copy is dead-lettered again without
  running); a copy goes to *oncely_dead_letter_queue* when one is set, then
  ``Reject(requeue=False)``: RabbitMQ routes the rejected message to the queue's dead-letter
  exchange if it has one. Other brokers drop rejected messages: set a dead-letter queue there.
  The copy is a task of its own (a new task id, no key header; the original's are in its
  ``oncely-original-id`` and ``oncely-original-key`` headers), so a worker consuming that
  queue re-drives it once rather than dead-lettering it forever; a copy dead-lettered in turn
  is rejected without another copy. If the copy cannot be sent, the task is retried (and
  dead-lettered again, without running), not acked away.

The task id is the natural key of a Celery message: give the same ``task_id`` to each retry of
a publish (`celery_options` does, from an HTTP request's key) and duplicates collapse too.
``apply_async`` sends such an id as the key and a digest of the arguments, the key kept in its
header, so that a key reused with other arguments is a task of its own: it is dead-lettered,
and its caller's ``AsyncResult.get()`` raises `oncely.errors.FingerprintMismatchError`.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import hashlib
import inspect
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from oncely._core.codec import Codec
from oncely._core.fingerprint import canonical_json
from oncely._core.protocols import SyncStore
from oncely._deps import require
from oncely._log import fields, get_logger
from oncely.consumers._consumer import IdempotentConsumer
from oncely.consumers._verdicts import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    Delivery,
    FingerprintSource,
    KeySource,
    Reason,
    Verdict,
    seconds,
)
from oncely.errors import ConfigurationError, FingerprintError
from oncely.keys import from_header

_celery = require("celery", extra="celery")
_exceptions = require("celery.exceptions", extra="celery")

__all__ = ["celery_options", "IdempotentTask"]

logger = get_logger(__name__)


def celery_options(key: str, *, header: str = KEY_HEADERS[0]) -> dict[str, Any]:
    """Return ``apply_async`` options carrying *key*: as the task id and as a header.

    .. code-block:: python

        charge.apply_async(args, **celery_options(request.headers["Idempotency-Key"]))

    Raises:
        InvalidKeyError: *key* is empty, too long or not header-safe.

    .. versionadded:: 0.1.0
    """
    key = from_header(key)
    return {"task_id": key, "headers": {header: key}}


def _arguments(
    args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, *, required: bool = True
) -> bytes:
    """The canonical JSON of a task's arguments: the `Delivery.body` keys and fingerprints
    read, the same in every process and on every redelivery.

    Raises:
        FingerprintError: An argument has no canonical form (an object a pickle serializer
            carries, say) and *required*; otherwise the body is empty.
    """
    try:
        return canonical_json({"args": list(args or ()), "kwargs": dict(kwargs or {})}).encode()
    except FingerprintError:
        if required:
            raise
        return b""


def _option(task: Any, name: str) -> Any:
    """Read a task option unbound: Celery stores options as class attributes, where a plain
    function (a key callable) would otherwise become a method of the task."""
    value = inspect.getattr_static(type(task), name)
    return value.__func__ if isinstance(value, staticmethod) else value


_Task: Any = _celery.Task

_COPY_REASON = "oncely-dead-letter-reason"
"""The header of a dead-letter copy: why its original was dead-lettered."""


class IdempotentTask(_Task):  # type: ignore[misc]
    """A Celery task base class: the task takes effect once per key, acked late.

    .. versionadded:: 0.1.0
    """

    acks_late = True
    reject_on_worker_lost = True
    max_retries = None  # retries are oncely's: bounded by the record's attempts, not here

    oncely_store: ClassVar[SyncStore | None] = None
    oncely_group: ClassVar[str | None] = None
    oncely_policy: ClassVar[ConsumerPolicy | None] = None
    oncely_key: ClassVar[KeySource] = "header"
    oncely_key_headers: ClassVar[tuple[str, ...]] = KEY_HEADERS
    oncely_fingerprint: ClassVar[FingerprintSource] = "body"
    oncely_codec: ClassVar[Codec | None] = None
    oncely_dead_letter_queue: ClassVar[str | None] = None

    _oncely_runner: IdempotentConsumer | None = None

    @property
    def oncely(self) -> IdempotentConsumer:
        """The runner of this task (its ``stats`` count verdicts in this process)."""
        if self._oncely_runner is None:
            if self.oncely_store is None:
                raise ConfigurationError(f"task {self.name} needs oncely_store=")
            if not self.acks_late:
                raise ConfigurationError(f"task {self.name} must keep acks_late=True")
            self._oncely_runner = IdempotentConsumer(
                self.oncely_store,
                scope=self.oncely_group or f"celery:{self.name}",
                policy=self.oncely_policy,
                key=_option(self, "oncely_key"),
                key_headers=self.oncely_key_headers,
                fingerprint=_option(self, "oncely_fingerprint"),
                codec=self.oncely_codec,
            )
        return self._oncely_runner

    def _reads_arguments(self) -> bool:
        """Whether the key or the fingerprint is made from the task's arguments."""
        key, fingerprint = _option(self, "oncely_key"), _option(self, "oncely_fingerprint")
        return bool(key == "content" or fingerprint == "body")

    def _body(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> bytes:
        try:
            return _arguments(args, kwargs, required=self._reads_arguments())
        except FingerprintError as exc:
            raise FingerprintError(
                f"the arguments of task {self.name} have no stable canonical form ({exc}): "
                "pass JSON-like values (dataclasses, dates, UUIDs and decimals are fine), or "
                "set oncely_fingerprint=None or a callable"
            ) from exc

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        """Send the task, refusing arguments whose fingerprint would change between
        deliveries (`oncely.errors.FingerprintError`, before anything is sent).

        A task id that is the key (as `celery_options` gives it) becomes the key and a digest
        of the arguments, the key staying in its header: a retry of the same call keeps one id,
        and a key reused with other arguments is another task, whose result says so."""
        body = self._body(args, kwargs)
        task_id = options.get("task_id")
        if task_id is not None and _option(self, "oncely_fingerprint") is not None:
            options = self._keyed(str(task_id), body, options)
        return super().apply_async(args, kwargs, *rest, **options)

    def _keyed(self, task_id: str, body: bytes, options: dict[str, Any]) -> dict[str, Any]:
        if _option(self, "oncely_key") != "header":
            return options
        headers = dict(options.get("headers") or {})
        wanted = {name.lower() for name in self.oncely_key_headers}
        key = next((v for name, v in headers.items() if name.lower() in wanted), None)
        if key is None:  # the task id is the key: it moves to the header
            key = headers[self.oncely_key_headers[0]] = task_id
        if key != task_id:  # an id of the caller's own, or one made here already
            return options
        arguments = hashlib.sha256(body).hexdigest()[:16]
        return {**options, "task_id": f"{key}.{arguments}", "headers": headers}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task once per key; duplicates return the stored result."""
        request = self.request
        if request.called_directly:  # a plain function call, not a delivered message
            return super().__call__(*args, **kwargs)
        runner = self.oncely
        headers = dict(request.headers or {})
        try:
            body = self._body(args, kwargs)
        except FingerprintError as exc:  # sent by a client that bypassed apply_async's check
            logger.error("task dead-lettered: %s", exc, extra=fields(outcome="dead_lettered"))
            runner.stats.add(Reason.INVALID_KEY)
            verdict = Verdict(Action.DEAD_LETTER, Reason.INVALID_KEY, error=exc)
        else:
            delivery = Delivery(body, headers, request.id, raw=request)
            # The worker pushed this request already: run() sees it as self.request.
            verdict = runner.process(delivery, lambda: self.run(*args, **kwargs))
        if verdict.action is Action.ACK:
            return verdict.result
        if verdict.action is Action.RETRY:
            delay = verdict.delay if verdict.delay is not None else runner.policy.retry_delay
            raise self.retry(
                args=args,
                kwargs=kwargs,
                countdown=seconds(delay),
                exc=verdict.error,
            )
        if verdict.error is not None and not (self.ignore_result or request.ignore_result):
            # The caller's AsyncResult fails with the reason (a reused key: the mismatch).
            self.backend.mark_as_failure(request.id, verdict.error, request=request)
        if self.oncely_dead_letter_queue is not None and _COPY_REASON not in headers:
            try:
                self._park(args, kwargs, headers, verdict)
            except Exception as exc:
                # Not acked away: the decision is in the record, so the task that comes back
                # is dead-lettered again without running.
                logger.error(
                    "could not dead-letter key=%s; retrying: %s",
                    verdict.key,
                    exc,
                    extra=fields(key=verdict.key, outcome="dead_letter_failed"),
                )
                raise self.retry(
                    args=args,
                    kwargs=kwargs,
                    countdown=seconds(runner.policy.retry_delay),
                    exc=exc,
                ) from exc
        raise _exceptions.Reject(f"dead-lettered: {verdict.reason}", requeue=False)

    def _park(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        headers: dict[str, Any],
        verdict: Verdict,
    ) -> None:
        """Copy the task to the dead-letter queue as a task of its own.

        The copy gets a new task id and loses the key headers (kept as ``oncely-original-id``
        and ``oncely-original-key``): under the original key it would only be dead-lettered
        again by the worker that consumes it. Running it is a re-drive, once; a copy that is
        dead-lettered in turn is rejected without another copy.
        """
        wanted = {name.lower() for name in self.oncely_key_headers}
        copy = {name: value for name, value in headers.items() if name.lower() not in wanted}
        copy[_COPY_REASON] = str(verdict.reason)
        copy["oncely-original-id"] = self.request.id
        if verdict.key is not None:
            copy["oncely-original-key"] = verdict.key.partition("|")[2] or verdict.key
        super().apply_async(
            args,
            kwargs,
            queue=self.oncely_dead_letter_queue,
            task_id=str(uuid.uuid4()),
            headers=copy,
        )
