"""A loopback TCP proxy that lets one request through and cuts the connection before its reply.

This is the lost reply: the server applied the command (a Lua script ran, a statement
committed), but the client only sees its connection die, and a driver or store that re-sends
the command must recognise the effect the first send had.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

from oncely import Acquired, InProgress, LeaseLost, Status
from oncely.testing.conformance import StoreCalls

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class ReplyCutter:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:*target_port*; `arm` cuts one reply.

    Once armed with a *marker*, the first request bytes that contain it mark their connection:
    the server's reply on that connection is swallowed until *until* has been seen in it (the
    whole reply: for PostgreSQL, ReadyForQuery, so the statement has committed), and then both
    sides of the connection are reset; armed with ``hold=True`` the connection stays open
    instead and the reply never comes (the client times out). Later connections pass untouched.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.cuts = 0
        self._lock = threading.Lock()
        self._marker: bytes | None = None
        self._until = b""
        self._hold = False
        self._times = 0
        self._sockets: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> ReplyCutter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def arm(self, marker: bytes, *, until: bytes = b"", hold: bool = False, times: int = 1) -> None:
        """Cut the reply to the next request that contains *marker* (once *until* came), and
        to the next ones after it, *times* in all."""
        with self._lock:
            self._marker, self._until, self._hold, self._times = marker, until, hold, times

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            self._reset(sock)

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        with contextlib.suppress(OSError):
            # close() alone would not end a connection another thread is blocked reading
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                self._reset(client)
                continue
            with self._lock:
                self._sockets += [client, server]
            cut = threading.Event()  # this connection's next reply is to be cut
            until: list[Any] = [b"", False]  # what ends the reply, and whether to hold it
            threading.Thread(
                target=self._requests, args=(client, server, cut, until), daemon=True
            ).start()
            threading.Thread(
                target=self._replies, args=(server, client, cut, until), daemon=True
            ).start()

    def _requests(
        self, client: socket.socket, server: socket.socket, cut: threading.Event, until: list[Any]
    ) -> None:
        try:
            while data := client.recv(1 << 20):
                with self._lock:
                    if self._marker is not None and self._marker in data:
                        self._times -= 1
                        if self._times <= 0:
                            self._marker = None
                        until[:] = [self._until, self._hold]
                        cut.set()
                server.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)

    def _replies(
        self, server: socket.socket, client: socket.socket, cut: threading.Event, until: list[Any]
    ) -> None:
        swallowed = b""
        try:
            while data := server.recv(1 << 20):
                if not cut.is_set():
                    client.sendall(data)
                    continue
                swallowed += data
                if until[0] in swallowed:
                    with self._lock:
                        self.cuts += 1
                    if until[1]:  # hold: the reply never comes, the connection stays open
                        continue
                    self._reset(client)
                    self._reset(server)
                    return
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)


VERBS = (
    "claim",
    "takeover",
    "complete",
    "fail",
    "release",
    "extend",
    "claim_many",
    "complete_many",
)
"""Every transition whose reply `assert_lost_reply_is_recognised` cuts."""


def assert_lost_reply_is_recognised(
    api: StoreCalls,
    cutter: ReplyCutter,
    verb: str,
    key: str,
    *,
    until: bytes = b"",
    hold: bool = False,
) -> None:
    """Cut the reply to *verb* on *key* once: the caller gets the answer the reply carried.

    With *hold* the reply never comes and the connection stays open: the client times out.
    Then a new call of the same verb is answered as a second call (not recognised as a re-send),
    so recognising a re-send cannot hide a real duplicate.
    """
    lease, ttl = timedelta(seconds=30), timedelta(minutes=5)
    marker = key.encode()
    if verb == "claim":
        cutter.arm(marker, until=until, hold=hold)
        assert api.claim(key, "fp", lease=lease, ttl=ttl) == Acquired(1, recovered=False)
        assert isinstance(api.claim(key, "fp", lease=lease, ttl=ttl), InProgress)
    elif verb == "takeover":
        first = api.claim(key, "fp", lease=timedelta(milliseconds=300), ttl=ttl)
        assert isinstance(first, Acquired)
        time.sleep(0.4)
        cutter.arm(marker, until=until, hold=hold)
        answer = api.claim(key, "fp", lease=lease, ttl=ttl)
        assert answer == Acquired(2, recovered=True, attempt=2), answer
        assert isinstance(api.claim(key, "fp", lease=lease, ttl=ttl), InProgress)
    elif verb in ("complete", "fail"):
        token = api.claim(key, "fp", lease=lease, ttl=ttl).token
        cutter.arm(marker, until=until, hold=hold)
        settle = api.complete if verb == "complete" else api.fail
        assert settle(key, token, b"done", ttl=ttl) is None
        record = api.get(key)
        assert record is not None
        status = Status.COMPLETED if verb == "complete" else Status.FAILED
        assert (record.status, record.token, record.result) == (status, token, b"done")
        assert settle(key, token, b"done", ttl=ttl) == LeaseLost()
    elif verb == "release":
        token = api.claim(key, "fp", lease=lease, ttl=ttl).token
        cutter.arm(marker, until=until, hold=hold)
        assert api.release(key, token) is None
        assert api.release(key, token) == LeaseLost()
        assert api.claim(key, "fp", lease=lease, ttl=ttl) == Acquired(token + 1, attempt=2)
    elif verb == "extend":
        token = api.claim(key, "fp", lease=lease, ttl=ttl).token
        cutter.arm(marker, until=until, hold=hold)
        assert api.extend(key, token, lease=lease * 2) is None
        record = api.get(key)
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, token)
    elif verb == "claim_many":
        keys = [key, f"{key}-2"]
        cutter.arm(marker, until=until, hold=hold)
        answers = api.claim_many([(one, "fp") for one in keys], lease=lease, ttl=ttl)
        assert answers == [Acquired(1, recovered=False)] * 2, answers
        again = api.claim_many([(one, "fp") for one in keys], lease=lease, ttl=ttl)
        assert all(isinstance(answer, InProgress) for answer in again), again
    elif verb == "complete_many":
        keys = [key, f"{key}-2"]
        claimed = api.claim_many([(one, "fp") for one in keys], lease=lease, ttl=ttl)
        items = [(one, answer.token, b"done") for one, answer in zip(keys, claimed, strict=True)]
        cutter.arm(marker, until=until, hold=hold)
        assert api.complete_many(items, ttl=ttl) == [None, None]
        for one in keys:
            record = api.get(one)
            assert record is not None
            assert (record.status, record.result) == (Status.COMPLETED, b"done")
        assert api.complete_many(items, ttl=ttl) == [LeaseLost(), LeaseLost()]
    else:  # pragma: no cover - a typo in a test's parameters
        raise ValueError(verb)
    assert cutter.cuts >= 1, "the proxy never cut a reply: the test did not test anything"
