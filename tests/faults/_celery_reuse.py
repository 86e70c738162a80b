"""Histories of a Celery key reused with other arguments, its callers reading a result backend.

``reuse`` on the ``celery`` entry: a Celery worker (`oncely.consumers.celery.IdempotentTask`,
RabbitMQ, a Redis result backend under the history's own key prefix) serves one client. The
client sends a task with a key and ``cents=500`` and reads its result; then a task with the same
key and ``cents=900`` (another payload: the worker dead-letters it without running) and reads
that one's result; then reads the first task's result again. The promise, on top of the usual
check: the second caller is told `oncely.errors.FingerprintMismatchError`, and no caller is
ever given a result made from other arguments than its own (the first task's result stays the
first run's). Anything else is a ``hidden_mismatch``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tests.faults._brokers import CeleryQueue, _Member, celery_app
from tests.faults._checker import Anomaly, check
from tests.faults._history import History, now

if TYPE_CHECKING:
    from tests.faults._campaign import Plan, Result, Services

FAULTS = ("reuse",)

TASK = "faults.charge_cents"

FIRST, OTHER = 500, 900
"""The first task's ``cents`` and the reused key's."""

_WAIT = 60.0
"""Seconds a caller waits for its result: a safety net, never reached when things work."""


def applicable(store: str, entry: str) -> bool:
    """One history: Celery on a Redis store (the campaign's own Redis holds the results)."""
    return entry == "celery" and store == "redis"


def _app(config: Mapping[str, Any]) -> Any:
    app = celery_app(config["url"], config["queue"])
    app.conf.update(
        result_backend=config["backend"],
        result_backend_transport_options={"global_keyprefix": config["prefix"]},
        task_ignore_result=False,
    )
    return app


def member(config: dict[str, Any], pipe: Any) -> None:
    """A Celery worker process (solo pool) whose task writes its effect and returns what it
    was given; SIGTERM is its warm shutdown."""
    import psycopg

    from oncely.consumers.celery import IdempotentTask

    worker = _Member(config, pipe)
    app = _app(config)

    def charge(key: str, cents: int) -> dict[str, Any]:
        op, token = worker.started(key)
        try:
            with psycopg.connect(worker.effects.url, autocommit=True) as conn:
                if worker.effects.begin(conn, key, token) is None:
                    worker.wrote(op, key, token, worker.effects.write(conn, key, op, token))
            return {"op": op, "token": token, "cents": cents}
        finally:
            worker.ended(op, key)

    app.task(
        name=TASK,
        base=IdempotentTask,
        oncely_store=worker.store,
        oncely_group=config["group"],
        oncely_policy=worker.policy,
        shared=False,
    )(charge)
    try:
        app.worker_main(
            [
                "--quiet",
                "worker",
                "-P",
                "solo",
                "--loglevel=ERROR",  # the reuse's dead-letter still shows: an expected error
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
                f"--hostname={worker.worker}-{config['queue']}@%h",
            ]
        )
    except SystemExit:
        pass
    finally:
        with contextlib.suppress(Exception):
            worker.store.close()
        pipe.close()


def run_history(plan: Plan, services: Services) -> Result:
    """The worker, then the client's three calls in order, then the check."""
    from oncely.consumers.celery import IdempotentTask, celery_options
    from tests.faults._campaign import Result, _Process

    started = now()
    key = f"h{plan.index}-{services.run}-k0"
    history = History(plan.name, ttl=300.0, keys=[key], lease=plan.lease)
    lock = threading.Lock()
    assert services.effects is not None
    assert services.rabbitmq is not None
    assert services.redis is not None
    name = f"oncely-faults-{services.run}-h{plan.index}"
    config = {
        "broker": "celery",
        "url": services.rabbitmq,
        "queue": name,
        "backend": services.redis.url,
        "prefix": f"{name}:",
        "store": services.store_spec(plan, None),
        "effects": {"url": services.effects.url, "schema": services.effects.schema},
        "group": name,
        "lease": plan.lease,
        "worker": "W",
    }

    def event(ev: str, op: str, **fields: Any) -> None:
        with lock:
            history.add({"ev": ev, "op": op, "key": key, "worker": "client", "t": now(), **fields})

    app = _app(config)

    def never(key: str, cents: int) -> None:
        raise AssertionError("the client only sends")

    charge = app.task(name=TASK, base=IdempotentTask, shared=False)(never)
    worker = _Process(config, history, lock, member)
    try:

        def call(op: str, cents: int, read: Any) -> None:
            event("invoke", op, cents=cents, reuse=cents != FIRST)
            try:
                value = read().get(timeout=_WAIT)
            except Exception as exc:
                event("fail", op, error=type(exc).__name__, message=str(exc)[:200])
            else:
                event("ok", op, value=value, cents=cents)

        first: list[Any] = []

        def send_first() -> Any:
            first.append(charge.apply_async((key, FIRST), **celery_options(key)))
            return first[0]

        call("A", FIRST, send_first)
        call("B", OTHER, lambda: charge.apply_async((key, OTHER), **celery_options(key)))
        if first:  # the first task's result, read again once the reuse has been handled
            call("A-again", FIRST, lambda: app.AsyncResult(first[0].id))
    finally:
        if worker.process.is_alive():
            assert worker.process.pid is not None
            os.kill(worker.process.pid, 15)
        worker.join(10)
        app.close()
        CeleryQueue(services.rabbitmq, name).unacked()  # drains and deletes the queue
    rows = services.effects.rows([key])
    anomalies = check(history, rows) + hidden_mismatches(history)
    return Result(plan, history, anomalies, [plan.fault], now() - started)


def hidden_mismatches(history: History) -> list[Anomaly]:
    """A reused key's caller not told `FingerprintMismatchError`, or any caller given the
    result of a run made from other arguments than its own."""
    anomalies: list[Anomaly] = []
    answers = {event["op"]: event for event in (*history.of("ok"), *history.of("fail"))}
    for invoke in history.of("invoke"):
        if not invoke.get("reuse"):
            continue
        answer = answers.get(invoke["op"])
        if answer is None or answer.get("error") != "FingerprintMismatchError":
            got = "no answer" if answer is None else answer.get("error") or "a result"
            anomalies.append(
                Anomaly(
                    "hidden_mismatch",
                    invoke["key"],
                    f"{invoke['op']} reused the key with other arguments and got {got}, "
                    "not FingerprintMismatchError",
                )
            )
    for ok in history.of("ok"):
        if ok["value"].get("cents") != ok["cents"]:
            anomalies.append(
                Anomaly(
                    "hidden_mismatch",
                    ok["key"],
                    f"{ok['op']} sent cents={ok['cents']} but got the result of "
                    f"{ok['value']['op']}, run with cents={ok['value'].get('cents')}",
                )
            )
    return anomalies
