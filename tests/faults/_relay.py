"""Relay histories for the fault campaign: the transactional outbox under faults.

One history: an application writes events of four ordering keys to RabbitMQ queues in its own
PostgreSQL transactions (some before the relays start, some while they run); relays (separate
processes, two at a time) publish them through `oncely.outbox.rabbitmq.RabbitMQPublisher`; the
fault strikes; once every event that can be published is, the queues are read through the
oncely RabbitMQ consumer (`IdempotentHandler`), whose handler records one effect per message
it runs. The faults (``entry`` is ``relay``):

- ``kill@publish``, ``kill@batch``, ``kill@mark``: relay A is SIGKILLed at its second publish
  call, before sending, with half the batch sent, or after the broker confirmed the batch but
  before the relay marked it; two other relays take over.
- ``broker-down``: the relays reach RabbitMQ through a proxy that goes down for a while.
- ``poison``: one event the broker always refuses (too large for its queue): dead-lettered.
- ``hang``: one event whose publish call never returns: dead-lettered after its timeouts.
- ``destinations``: a third of the events, of the same keys, go to an exchange that does not
  exist: they stay pending, and must not hold back the others.
- ``refusal``: the broker refuses one event once, on a destination already confirmed, while
  the next event of its scope, pipelined behind it, is accepted.

The checks (`check`), per scope (destination and ordering key), in the scope's commit order,
which is id order (not ``seq`` order: once none of a key's events is pending, a purge deletes
the key's counter and its next event is numbered 1 again, so a later event of a scope can carry
a lower seq than the published ones before it):

- ``lost_event``: an event to a working destination that is not dead-lettered has no effect.
- ``duplicate_effect``: the consumer ran one message id twice.
- ``out_of_order``: the effects of a scope are not in commit order (not judged for a scope
  where the broker refused an event: a pipelined send may pass it, by design; see the outbox
  guide's *Ordering*).
- ``marked_out_of_order``: an event was marked published while an earlier event of its scope
  was neither published nor dead-lettered (the relay's own promise, read from the table).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.faults._checker import Anomaly
from tests.faults._history import History, now

ENTRY = "relay"
FAULTS = (
    "kill@publish",
    "kill@batch",
    "kill@mark",
    "broker-down",
    "poison",
    "hang",
    "destinations",
    "refusal",
)
KINDS = ("lost_event", "duplicate_effect", "out_of_order", "marked_out_of_order")

ROOT = Path(__file__).resolve().parents[2]
_KEYS = 4
_BEFORE, _DURING = 40, 20
"""Events written before the relays start, and while they run."""
_SPECIAL = 25
"""The event the fault is about (poison, hang, refusal): in a later batch than the first."""
_QUEUE_BYTES = 65_536
_OVERSIZED = b"x" * (2 * _QUEUE_BYTES)
_SETTLE = 30.0
"""Seconds a history waits for every event that can be published to be (a safety net)."""


def applicable(store: str, entry: str, fault: str) -> bool:
    """Relay histories run on PostgreSQL, each fault once."""
    return entry == ENTRY and fault in FAULTS and store == "postgres"


# -- the relay process ----------------------------------------------------------------------------


class _Faulty:
    """The relay's publisher, with the history's fault injected at the driver's boundary."""

    def __init__(self, inner: Any, config: dict[str, Any]) -> None:
        self.inner = inner
        self.kill = config.get("kill", "")
        self.marker = config.get("marker", "")
        self.calls = 0

    async def publish(self, events: Sequence[Any]) -> Sequence[Any]:
        self.calls += 1
        if self.kill and self.calls == 2:
            if self.kill == "batch":
                await self.inner.publish(events[: max(1, len(events) // 2)])
            elif self.kill == "mark":
                await self.inner.publish(events)
            _touch(self.marker)
            await asyncio.sleep(3600)  # SIGKILLed here
        if any(event.headers.get("fault") == "hang" for event in events):
            await asyncio.sleep(3600)  # a call that never returns
        return await self.inner.publish([_refused(event) for event in events])

    async def aclose(self) -> None:
        await self.inner.aclose()


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _refused(event: Any) -> Any:
    """*event*, too large for its queue when the history says the broker refuses it."""
    fault = event.headers.get("fault")
    if fault == "poison" or (fault == "refuse-once" and event.attempts == 0):
        return dataclasses.replace(event, payload=_OVERSIZED)
    return event


def relay_main(config: dict[str, Any]) -> None:
    """Run one relay until SIGTERM (or SIGKILL)."""
    import oncely
    from oncely.outbox import Relay
    from oncely.outbox.rabbitmq import RabbitMQPublisher

    store = oncely.open_store(config["store"])
    publisher = _Faulty(RabbitMQPublisher.from_url(config["amqp"], timeout=5.0), config)
    relay = Relay(
        store,
        publisher,
        batch_size=10,
        poll_interval=0.05,
        backoff=0.05,
        max_backoff=0.3,
        publish_timeout=config["publish_timeout"],
        max_attempts=config["max_attempts"],
        retention=3600,
        # often: a key's counter is then deleted whenever the relays catch up with the writer,
        # and its next event numbered 1 again (the check orders by id)
        purge_interval=0.2,
    )
    try:
        relay.run_forever()
    finally:
        store.close()


# -- one history ----------------------------------------------------------------------------------


class _Relays:
    """The history's relay processes."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, **extra: Any) -> subprocess.Popen[bytes]:
        config = json.dumps({**self.base, **extra})
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults._relay", config],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@dataclasses.dataclass
class _Setup:
    name: str
    schema: str
    store_url: str
    amqp: str
    queues: list[str]
    missing: str


def run_history(plan: Any, services: Any) -> Any:
    """Run one relay history (see the module) and check it."""
    import oncely
    from tests._proxy import Proxy
    from tests.faults._campaign import Result

    started = now()
    history = History(plan.name)
    name = f"oncely-faults-{services.run}-h{plan.index}"
    schema = f"faults_relay_{services.run}_h{plan.index}"
    sep = "&" if "?" in services.postgres else "?"
    setup = _Setup(
        name=name,
        schema=schema,
        store_url=f"{services.postgres}{sep}schema={schema}&application_name=oncely_faults",
        amqp=services.rabbitmq,
        queues=[f"{name}-a", f"{name}-b"],
        missing=f"{name}-no-such-exchange/x",
    )
    fault = plan.fault
    asyncio.run(_declare(setup))
    store = oncely.open_store(setup.store_url)
    store.migrate()  # type: ignore[attr-defined]
    proxy: Proxy | None = None
    amqp = setup.amqp
    if fault == "broker-down":
        port = urlsplit(setup.amqp).port or 5672
        proxy = Proxy(port)
        proxy.up()
        amqp = setup.amqp.replace(f":{port}", f":{proxy.port}")
    base = {
        "store": setup.store_url,
        "amqp": amqp,
        "publish_timeout": 0.5 if fault == "hang" else 3.0,
        "max_attempts": {"poison": 3, "hang": 2, "destinations": 1000}.get(fault, 10),
    }
    relays = _Relays(base)
    faults: list[str] = []
    writer = _Writer(store, setup, fault)
    try:
        writer.write(range(_BEFORE))
        if fault.startswith("kill@"):
            marker = os.path.join(services.tmp, f"{name}.killed")
            victim = relays.start(kill=fault.partition("@")[2], marker=marker)
            if _wait(lambda: os.path.exists(marker), 20.0):
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                faults.append(fault)
                history.add({"ev": "fault", "kind": fault, "t": now()})
        relays.start()
        relays.start()
        during = threading.Thread(target=writer.write, args=(range(_BEFORE, _BEFORE + _DURING),))
        during.start()
        if proxy is not None:
            _wait(lambda: _counts(store, setup)["published"] >= 10, 20.0)
            proxy.down()
            faults.append(fault)
            history.add({"ev": "fault", "kind": fault, "t": now()})
            time.sleep(1.5)
            proxy.up()
        during.join()
        if fault in ("poison", "hang", "destinations", "refusal"):
            faults.append(fault)  # written into the events themselves
        _wait(lambda: _counts(store, setup)["healthy_pending"] == 0, _SETTLE)
    finally:
        relays.stop()
        if proxy is not None:
            proxy.close()
        rows = _rows(store, setup)
        effects = asyncio.run(_consume(setup))
        store.close()
        asyncio.run(_delete(setup))
        _drop(services.postgres, schema)
    anomalies = check(rows, effects, setup.missing)
    history.add({"ev": "checked", "rows": len(rows), "effects": len(effects), "t": now()})
    return Result(plan, history, anomalies, faults, now() - started)


class _Writer:
    """The application: events in its own transactions, four keys, two queues."""

    def __init__(self, store: Any, setup: _Setup, fault: str) -> None:
        import oncely

        self.outbox = oncely.Outbox(store)
        self.setup = setup
        self.fault = fault

    def write(self, numbers: range) -> None:
        import psycopg

        base = self.setup.store_url.split("?")[0]
        with psycopg.connect(base, autocommit=True) as connection:
            for number in numbers:
                key = f"k{number % _KEYS}"
                destination = self.setup.queues[number // _KEYS % 2]
                headers = {"n": str(number)}
                if self.fault == "destinations" and number % 3 == 0:
                    destination = self.setup.missing
                if number == _SPECIAL and self.fault in ("poison", "hang"):
                    headers["fault"] = self.fault
                if number == _SPECIAL and self.fault == "refusal":
                    headers["fault"] = "refuse-once"
                if self.fault == "refusal" and number >= _SPECIAL - 5:
                    # one scope from here on: the refused event and the next ones, pipelined
                    # behind it in one call, on a destination the relay had confirmed before
                    key, destination = "k1", self.setup.queues[0]
                with connection.transaction():
                    self.outbox.add(
                        connection, destination, f"e{number}", headers=headers, ordering_key=key
                    )
                if number >= _BEFORE:
                    time.sleep(0.02)


def _wait(test: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if test():
            return True
        time.sleep(0.05)
    return False


def _query(store: Any, setup: _Setup, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    base = setup.store_url.split("?")[0]
    with psycopg.connect(base, autocommit=True) as connection:
        table = f'"{setup.schema}".oncely_outbox'
        return list(connection.execute(sql.format(table=table)).fetchall())


def _counts(store: Any, setup: _Setup) -> dict[str, int]:
    published, healthy_pending = _query(
        store,
        setup,
        "SELECT count(*) FILTER (WHERE published_at IS NOT NULL), "
        "count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL "
        f"AND destination <> '{setup.missing}') FROM {{table}}",
    )[0]
    return {"published": published, "healthy_pending": healthy_pending}


def _rows(store: Any, setup: _Setup) -> list[dict[str, Any]]:
    rows = _query(
        store,
        setup,
        "SELECT id, message_id, destination, ordering_key, seq, published_at, dead_at, headers "
        "FROM {table} ORDER BY id",
    )
    names = ("id", "message_id", "destination", "key", "seq", "published_at", "dead_at", "headers")
    return [dict(zip(names, row, strict=True)) for row in rows]


def _drop(postgres: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(postgres, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def _declare(setup: _Setup) -> None:
    import aio_pika

    connection = await aio_pika.connect(setup.amqp)
    async with connection:
        channel = await connection.channel()
        arguments = {"x-max-length-bytes": _QUEUE_BYTES, "x-overflow": "reject-publish"}
        for queue in setup.queues:
            await channel.declare_queue(queue, arguments=arguments)


async def _delete(setup: _Setup) -> None:
    import aio_pika

    connection = await aio_pika.connect(setup.amqp)
    async with connection:
        channel = await connection.channel()
        for queue in setup.queues:
            with contextlib.suppress(Exception):
                await channel.queue_delete(queue)


async def _consume(setup: _Setup) -> list[tuple[str, str]]:
    """Every message in the queues, through the oncely consumer: (queue, message id) per run
    of the handler, in the order they ran."""
    import aio_pika

    from oncely.consumers import ConsumerPolicy
    from oncely.consumers.rabbitmq import IdempotentHandler
    from oncely.stores.memory import MemoryStore

    effects: list[tuple[str, str]] = []
    store = MemoryStore()
    connection = await aio_pika.connect(setup.amqp)
    async with connection:
        channel = await connection.channel()
        for name in setup.queues:
            queue = await channel.get_queue(name)

            async def handler(message: Any, name: str = name) -> None:
                effects.append((name, message.headers["Idempotency-Key"]))

            handle = IdempotentHandler(
                handler, store, group=setup.name, policy=ConsumerPolicy(lease=30)
            )
            while (message := await queue.get(no_ack=False, fail=False)) is not None:
                await handle(message)
    return effects


# -- the check ------------------------------------------------------------------------------------


def check(
    rows: Sequence[dict[str, Any]], effects: Sequence[tuple[str, str]], missing: str
) -> list[Anomaly]:
    """The anomalies of one relay history (see the module's list)."""
    anomalies: list[Anomaly] = []
    by_id = {row["message_id"]: row for row in rows}
    runs = Counter(message_id for _, message_id in effects)
    for message_id, count in runs.items():
        if count > 1:
            anomalies.append(
                Anomaly("duplicate_effect", message_id, f"the consumer ran it {count} times")
            )
    for row in rows:
        if row["destination"] != missing and row["dead_at"] is None and not runs[row["message_id"]]:
            state = "marked published" if row["published_at"] is not None else "still pending"
            anomalies.append(
                Anomaly("lost_event", row["message_id"], f"{state}, never consumed: {row}")
            )
    scopes: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        scopes[(row["destination"], row["key"])].append(row)
    for scope, members in scopes.items():
        members.sort(key=lambda row: row["id"])
        refused = any(_headers(row).get("fault") for row in members)
        seen = [by_id[m] for _, m in effects if m in by_id and _scope(by_id[m]) == scope]
        if not refused and seen != sorted(seen, key=lambda row: row["id"]):
            order = ", ".join(f"{row['id']} (seq {row['seq']})" for row in seen)
            anomalies.append(Anomaly("out_of_order", f"{scope}", f"consumed in id order {order}"))
        anomalies += _marks(scope, members)
    return anomalies


def _marks(scope: tuple[str, str], members: Sequence[dict[str, Any]]) -> list[Anomaly]:
    """An event marked published while an earlier one of its scope was not yet settled."""
    found = []
    for earlier, later in itertools.pairwise(members):
        if later["published_at"] is None:
            continue
        settled = earlier["published_at"] or earlier["dead_at"]
        if settled is None or settled > later["published_at"]:
            found.append(
                Anomaly(
                    "marked_out_of_order",
                    later["message_id"],
                    f"seq {later['seq']} of {scope} marked published at "
                    f"{later['published_at']}, seq {earlier['seq']} settled at {settled}",
                )
            )
    return found


def _scope(row: dict[str, Any]) -> tuple[str, str]:
    return (row["destination"], row["key"])


def _headers(row: dict[str, Any]) -> dict[str, str]:
    headers = row["headers"]
    return json.loads(headers) if isinstance(headers, str) else dict(headers)


if __name__ == "__main__":
    relay_main(json.loads(sys.argv[1]))
