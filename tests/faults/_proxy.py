"""A loopback TCP fault proxy in front of a store or broker: latency, cut replies, resets.

``FaultProxy(target_port)`` forwards ``127.0.0.1:<proxy.port>`` to ``127.0.0.1:<target_port>``
(threads and blocking sockets: a proxy must keep working while the test's event loop is busy).
Faults, each switched on and off at run time:

- ``latency``: every request waits this long before it is forwarded (a slow network or a store
  hiccup). A delay, not a queue: requests that follow each other are each delayed by it, they do
  not wait for each other's delay.
- ``cut_reply(pattern)``: the next request that contains *pattern* reaches the server, and its
  reply is dropped and the connection reset: the write happened, the client got an error.
- ``reset()``: reset every live connection; ``down()``/``up()``: refuse and reset, then accept.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with contextlib.suppress(OSError):  # wakes a thread blocked in recv(); close() alone does not
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class _Link:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.cut = False

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.server)


class FaultProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port>, with faults switched at run time."""

    def __init__(self, target_port: int, *, port: int = 0) -> None:
        self.target_port = target_port
        self.latency = 0.0
        self.cuts = 0
        """How many replies were cut so far."""
        self.accepted = 0
        """How many connections were accepted so far."""
        self._patterns: list[bytes] = []
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._listener: socket.socket | None = None
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        self.port: int = probe.getsockname()[1]
        probe.close()

    def __enter__(self) -> FaultProxy:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        """Accept connections (again, on the same port)."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(128)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and reset the live ones."""
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self.reset()

    close = down

    def reset(self) -> None:
        """Reset every live connection (the clients see ECONNRESET)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.reset()

    def cut_reply(self, pattern: bytes) -> None:
        """Let the next request containing *pattern* through, then drop its reply and reset."""
        with self._lock:
            self._patterns.append(pattern)

    def _take_pattern(self, data: bytes) -> bool:
        with self._lock:
            for index, pattern in enumerate(self._patterns):
                if pattern in data:
                    del self._patterns[index]
                    self.cuts += 1
                    return True
        return False

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            link = _Link(client, server)
            with self._lock:
                self.accepted += 1
                if self._listener is not listener:
                    link.reset()
                    return
                self._links.append(link)
            threading.Thread(target=self._requests, args=(link,), daemon=True).start()
            threading.Thread(target=self._replies, args=(link,), daemon=True).start()

    def _requests(self, link: _Link) -> None:
        due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        threading.Thread(target=self._forward, args=(link, due), daemon=True).start()
        try:
            while data := link.client.recv(65536):
                due.put((time.monotonic() + self.latency, data))
        except OSError:
            pass
        finally:
            due.put((0.0, b""))

    def _forward(self, link: _Link, due: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        try:
            while True:
                at, data = due.get()
                if not data:
                    break
                time.sleep(max(0.0, at - time.monotonic()))
                if self._take_pattern(data):
                    link.cut = True
                link.server.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                link.server.shutdown(socket.SHUT_WR)

    def _replies(self, link: _Link) -> None:
        try:
            while data := link.server.recv(65536):
                if link.cut:
                    link.reset()
                    return
                link.client.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                link.client.shutdown(socket.SHUT_WR)
