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

How the runner's verdicts (DESIGN.md section 6) become Celery's:

* ack: the task returns (Celery acks). A completed duplicate returns the first run's stored
  result without running;
* retry: ``self.retry(countdown=...)``: Celery publishes the task again (same id, so same key)
  and acks this delivery. A handler that raised is retried after the policy's ``retry_delay``;
  attempts are counted in the record, not in Celery's ``max_retries``;
* dead-letter: a copy goes to *oncely_dead_letter_queue* when one is set, then
  ``Reject(requeue=False)``: RabbitMQ routes the rejected message to the queue's dead-letter
  exchange if it has one. Other brokers drop rejected messages: set a dead-letter queue there.

The task id is the natural key of a Celery message: give the same ``task_id`` to each retry of
a publish (`celery_options` does, from an HTTP request's key) and duplicates collapse too.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

from oncely._core.codec import Codec
from oncely._core.fingerprint import canonical_json
from oncely._core.protocols import SyncStore
from oncely._deps import require
from oncely.consumers._base import (
    KEY_HEADERS,
    Action,
    ConsumerPolicy,
    Delivery,
    FingerprintSource,
    IdempotentConsumer,
    KeySource,
    seconds,
)
from oncely.errors import ConfigurationError, OncelyError
from oncely.keys import from_header

_celery = require("celery", extra="celery")
_exceptions = require("celery.exceptions", extra="celery")

__all__ = ["celery_options", "IdempotentTask"]


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


def _arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    try:
        return canonical_json({"args": list(args), "kwargs": dict(kwargs)}).encode()
    except OncelyError:  # arguments without a canonical form (pickle serializer)
        return repr((args, sorted(kwargs.items()))).encode()


def _option(task: Any, name: str) -> Any:
    """Read a task option unbound: Celery stores options as class attributes, where a plain
    function (a key callable) would otherwise become a method of the task."""
    value = inspect.getattr_static(type(task), name)
    return value.__func__ if isinstance(value, staticmethod) else value


_Task: Any = _celery.Task


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task once per key; duplicates return the stored result."""
        request = self.request
        if request.called_directly:  # a plain function call, not a delivered message
            return super().__call__(*args, **kwargs)
        runner = self.oncely
        headers = dict(request.headers or {})
        delivery = Delivery(_arguments(args, kwargs), headers, request.id, raw=request)
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
        if self.oncely_dead_letter_queue is not None:
            headers["oncely-dead-letter-reason"] = str(verdict.reason)
            self.apply_async(
                args,
                kwargs,
                queue=self.oncely_dead_letter_queue,
                task_id=request.id,
                headers=headers,
            )
        raise _exceptions.Reject(f"dead-lettered: {verdict.reason}", requeue=False)
