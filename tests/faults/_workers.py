"""The worker processes of a campaign: clients calling one entry point on one store.

`main` runs in a child process (forkserver) and sends every event of `tests.faults._history`
through its pipe. A config says which store, which entry point, which operations, and where
to die: a fault plan ``{"op", "point", "action"}`` makes the worker SIGKILL or SIGSTOP itself
when that operation reaches the point, after sending the ``fault`` event (so the history knows
the kill happened there). Points: ``claim`` (the lease was just taken), ``mid`` (the run
announced its token and is working), ``effect`` (its write stands, nothing is completed yet),
``complete`` (the call returned; the client has not been told yet).

A worker with ``retry_for`` > 0 is a client that retries each key (new op id each attempt)
until it gets a result or that many seconds pass: the duplicate pressure and the final read.
Several configs given together run as threads of one process (the memory store has no
other way to be shared).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import oncely
from tests.faults import _txn_begin
from tests.faults._effects import Effects, Fenced
from tests.faults._history import Event, now

Send = Callable[[Event], None]

_STORES: dict[str, Any] = {}
_RESUMED = threading.Event()
_GO = threading.Event()
"""Set by SIGUSR1: a worker started ahead with ``wait_go`` begins its ops."""
_STORES_LOCK = threading.Lock()


def main(configs: list[dict[str, Any]], pipe: Any) -> None:
    """Run every config (a thread each), then close the pipe."""
    lock = threading.Lock()

    def send(event: Event) -> None:
        with lock:
            pipe.send(event)

    skew = configs[0].get("skew", 0.0)
    if skew:
        _skew_clock(skew)
    signal.signal(signal.SIGCONT, lambda signum, frame: _RESUMED.set())
    signal.signal(signal.SIGUSR1, lambda signum, frame: _GO.set())
    threads = [threading.Thread(target=_run, args=(config, send)) for config in configs]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # the main thread must stay free to run the SIGCONT handler
            thread.join(0.05)
    send({"ev": "exit", "worker": configs[0]["worker"], "t": now()})
    pipe.close()


def _skew_clock(seconds: float) -> None:
    """This host's wall clock is off by *seconds* (the stores must judge time by theirs)."""
    real_time, real_ns = time.time, time.time_ns
    time.time = lambda: real_time() + seconds  # type: ignore[assignment] # a skewed host
    time.time_ns = lambda: real_ns() + int(seconds * 1e9)  # type: ignore[assignment] # likewise


def _store(config: dict[str, Any]) -> Any:
    spec = config["store"]
    name = f"{spec['url']}|{sorted(spec.get('options', {}).items())}"
    with _STORES_LOCK:
        if name not in _STORES:
            _STORES[name] = oncely.open_store(spec["url"], **spec.get("options", {}))
        return _STORES[name]


def _run(config: dict[str, Any], send: Send) -> None:
    client = _Client(config, send)
    if config.get("wait_go"):  # started ahead (imports made, store open): begin when told
        send({"ev": "ready", "worker": config["worker"], "t": now()})
        _GO.wait()
    if config["entry"] in ("async", "guard_async"):
        asyncio.run(client.arun_all())
    else:
        client.run_all()


class _Client:
    def __init__(self, config: dict[str, Any], send: Send) -> None:
        self.config = config
        self.worker: str = config["worker"]
        self.send = send
        self.store = _store(config)
        self.effects = Effects(config["effects"]["url"], config["effects"]["schema"])
        self.lease = timedelta(seconds=config["lease"])
        self.ttl = timedelta(seconds=config["ttl"])
        self.fault: dict[str, Any] | None = config.get("fault")
        self.local = threading.local()

    # -- events and faults ----------------------------------------------------------------------

    def event(self, ev: str, op: str, key: str, **fields: Any) -> None:
        self.send({"ev": ev, "op": op, "key": key, "worker": self.worker, "t": now(), **fields})

    def point(self, name: str, op: str, key: str) -> None:
        fault = self.fault
        if fault is None or fault["op"] != op or fault["point"] != name:
            return
        self.event("fault", op, key, kind=f"{fault['action']}@{name}", excuses=True)
        if fault["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()  # the signal may land a moment later: go no further
        # The stop may land a moment after kill() returns: wait for the SIGCONT, not the stop.
        os.kill(os.getpid(), signal.SIGSTOP)
        _RESUMED.wait()

    def attempts(self, spec: dict[str, Any]) -> Any:
        """The op ids to try for one key: one, or retries until ``retry_for`` runs out."""
        retry_for = self.config.get("retry_for", 0.0)
        deadline = now() + retry_for
        attempt = 0
        while True:
            attempt += 1
            done = yield f"{spec['op']}.{attempt}" if retry_for else spec["op"]
            if done or not retry_for or now() > deadline:
                return
            time.sleep(self.config.get("retry_gap", 0.1))

    def outcome(self, op: str, key: str, value: Any, error: BaseException | None) -> bool:
        if error is None:
            self.point("complete", op, key)
            self.event("ok", op, key, value=value)
            return True
        self.event("fail", op, key, error=type(error).__name__, message=str(error)[:200])
        return False

    # -- sync -----------------------------------------------------------------------------------

    def connection(self) -> Any:
        import psycopg

        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(self.effects.url, autocommit=True)
        return conn

    def body(self, op: str, key: str, token: int, hold: float) -> dict[str, Any]:
        self.event("run", op, key, token=token)
        try:
            self.point("claim", op, key)
            conn = self.connection()
            standing = self.effects.begin(conn, key, token)
            if standing is not None:
                self.event("adopt", op, key, of=standing[0])
                return {"op": standing[0], "token": standing[1]}
            time.sleep(hold)
            self.point("mid", op, key)
            accepted = self.effects.write(conn, key, op, token)
            self.event("effect", op, key, token=token, accepted=accepted)
            if not accepted:
                raise Fenced(f"{op}'s write with token {token} was rejected")
            self.point("effect", op, key)
            return {"op": op, "token": token}
        finally:
            self.event("end", op, key)

    def protected(self, function: Callable[..., Any]) -> Any:
        """*function* under `oncely.idempotent`, as every entry but the guards runs it."""
        return oncely.idempotent(
            store=self.store,
            key="key",
            scope="faults",
            fingerprint=None,
            lease=self.lease,
            ttl=self.ttl,
        )(function)

    def txn_function(self, hold: float) -> Any:
        """The ``txn`` entry: the effect is written in a transaction that commits with the
        key's record (`oncely.Inbox.transactional` under `oncely.idempotent`), so it stands
        only once that commit is made: the ``effect`` event and point come after it (a kill
        there is the window a transaction closes: written, and nothing but the transaction
        completed the record). Nothing adopts a standing write: a second run's write would
        stand too, and the checker would see a double effect."""
        import psycopg

        url = self.config["txn_url"]

        @oncely.Inbox(self.store).transactional(lambda: psycopg.connect(url))
        def write(key: str, op: str, token: int) -> dict[str, Any]:
            self.point("claim", op, key)
            time.sleep(hold)
            self.point("mid", op, key)
            if not self.effects.write(oncely.current_transaction(), key, op, token):
                raise Fenced(f"{op}'s write with token {token} was rejected")
            return {"op": op, "token": token}

        def run(key: str, op: str) -> dict[str, Any]:
            token = _token()
            self.event("run", op, key, token=token)
            try:
                value = write(key, op, token)
                self.event("effect", op, key, token=token, accepted=True)  # committed
                self.point("effect", op, key)
                return value
            finally:
                self.event("end", op, key)

        return self.protected(run)

    def run_all(self) -> None:
        ops = self.config["ops"]
        if self.config.get("concurrent"):
            threads = [threading.Thread(target=self.run_one, args=(spec,)) for spec in ops]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for spec in ops:
                self.run_one(spec)

    def run_one(self, spec: dict[str, Any]) -> None:
        key, hold = spec["key"], spec.get("hold", 0.0)
        guard = self.config["entry"] == "guard"
        if self.config["entry"] == "txn":
            function = self.txn_function(hold)
        elif self.config["entry"] == _txn_begin.ENTRY:
            function = _txn_begin.function(self, hold)
        elif not guard:
            function = self.protected(lambda key, op: self.body(op, key, _token(), hold))
        attempts = self.attempts(spec)
        op = next(attempts)
        while True:
            self.event("invoke", op, key)
            value: Any = None
            error: BaseException | None = None
            try:
                if guard:
                    with oncely.Guard(
                        self.store, key, scope="faults", lease=self.lease, ttl=self.ttl
                    ) as held:
                        if held.replayed:
                            value = held.result
                        else:
                            value = self.body(op, key, held.token, hold)
                            held.complete(value)
                else:
                    value = function(key, op)
            except Exception as exc:
                error = exc
            try:
                op = attempts.send(self.outcome(op, key, value, error))
            except StopIteration:
                return

    # -- async ----------------------------------------------------------------------------------

    async def abody(self, conn: Any, op: str, key: str, token: int, hold: float) -> Any:
        self.event("run", op, key, token=token)
        try:
            self.point("claim", op, key)
            standing = await self.effects.abegin(conn, key, token)
            if standing is not None:
                self.event("adopt", op, key, of=standing[0])
                return {"op": standing[0], "token": standing[1]}
            await asyncio.sleep(hold)
            self.point("mid", op, key)
            accepted = await self.effects.awrite(conn, key, op, token)
            self.event("effect", op, key, token=token, accepted=accepted)
            if not accepted:
                raise Fenced(f"{op}'s write with token {token} was rejected")
            self.point("effect", op, key)
            return {"op": op, "token": token}
        finally:
            self.event("end", op, key)

    async def arun_all(self) -> None:
        ops = self.config["ops"]
        if self.config.get("concurrent"):
            await asyncio.gather(*(self.arun_one(spec) for spec in ops))
        else:
            for spec in ops:
                await self.arun_one(spec)

    async def arun_one(self, spec: dict[str, Any]) -> None:
        import psycopg

        key, hold = spec["key"], spec.get("hold", 0.0)
        guard = self.config["entry"] == "guard_async"
        conn = await psycopg.AsyncConnection.connect(self.effects.url, autocommit=True)
        try:

            async def handler(key: str, op: str) -> Any:
                return await self.abody(conn, op, key, _token(), hold)

            function = self.protected(handler)
            attempts = self.attempts(spec)
            op = next(attempts)
            while True:
                self.event("invoke", op, key)
                value: Any = None
                error: BaseException | None = None
                try:
                    if guard:
                        async with oncely.Guard(
                            self.store, key, scope="faults", lease=self.lease, ttl=self.ttl
                        ) as held:
                            if held.replayed:
                                value = held.result
                            else:
                                value = await self.abody(conn, op, key, held.token, hold)
                                await held.acomplete(value)
                    else:
                        value = await function(key, op)
                except Exception as exc:
                    error = exc
                try:
                    op = attempts.send(self.outcome(op, key, value, error))
                except StopIteration:
                    return
        finally:
            await conn.close()


def _token() -> int:
    lease = oncely.current_lease()
    assert lease is not None
    return lease.token
