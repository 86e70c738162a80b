"""A loopback TCP proxy between a client and a server, with faults switched on at run time.

``Proxy(target_port)`` listens on ``127.0.0.1:<proxy.port>`` at once and forwards each
connection to ``<host>:<target_port>`` (threads and blocking sockets: a proxy must keep working
while the test's event loop is busy). Its faults:

- ``latency``: every request waits this long before it is forwarded (a slow network or a store
  hiccup). A delay, not a queue: requests that follow each other are each delayed by it, they do
  not wait for each other's delay.
- ``connect_delay``: every connection after the first ``prompt_connects`` takes this long to
  open (a server slow to accept).
- `arm` and `cut_reply`: the reply to a request that carries a marker is lost (the write
  happened, the client got an error or no answer), or the request itself is dropped.
- ``responses``: HTTP replies spoiled while their body travels, one fault per connection.
- `reset`: reset every live connection; `down`/`up`: refuse new connections (and end the live
  ones), then accept again on the same port.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with contextlib.suppress(OSError):  # wakes a thread blocked in recv(); close() alone does not
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _drop(sock: socket.socket) -> None:
    """Reset *sock* without a FIN first, while another thread may be blocked reading it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with contextlib.suppress(OSError):  # wakes the reader, sends nothing: the close resets
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


def _abort(sock: socket.socket) -> None:
    """Close *sock* with a reset once no other thread holds it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with contextlib.suppress(OSError):
        sock.close()


def _end(sock: socket.socket) -> None:
    """Close *sock* with a FIN each way, as a server that went away cleanly."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@dataclass
class _Cut:
    marker: bytes
    until: bytes = b""
    hold: bool = False
    request: bool = False
    times: int = 1


class _Link:
    def __init__(self, client: socket.socket, server: socket.socket, response: str | None) -> None:
        self.client = client
        self.server = server
        self.response = response
        self.cut: _Cut | None = None

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.server)

    def end(self) -> None:
        _end(self.client)
        _end(self.server)


class Proxy:
    """Forwards 127.0.0.1:<port> to <host>:<target_port>, with faults switched at run time.

    Args:
        target_port: The server's port.
        host: The server's host.
        port: The port to listen on (0: any free one).
        responses: For HTTP: each accepted connection takes the next of these faults, and
            passes untouched once they run out. A faulty connection forwards the request whole,
            and the reply up to the end of its headers plus *body_bytes* of body; then
            ``"stall"`` forwards nothing more (the client's read times out), and ``"reset"``
            resets the client's connection.
        connect_delay: How long each connection after the first *prompt_connects* waits
            before the proxy opens its way to the server.
    """

    def __init__(
        self,
        target_port: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        responses: Iterable[str] = (),
        body_bytes: int = 8,
        connect_delay: float = 0.0,
        prompt_connects: int = 1,
    ) -> None:
        self.target = (host, target_port)
        self.latency = 0.0
        self.connect_delay = connect_delay
        self.prompt_connects = prompt_connects
        self.body_bytes = body_bytes
        self.accepted = 0
        """How many connections were accepted so far."""
        self.cuts = 0
        """How many replies were cut (or requests dropped) so far."""
        self.cut = threading.Event()
        """Set once a request carrying an armed marker went by."""
        self._responses = deque(responses)
        self._cuts: list[_Cut] = []
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._listener: socket.socket | None = None
        self.port = port
        self.up()

    @property
    def url(self) -> str:
        """The proxy's address as an HTTP URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults ----------------------------------------------------------------------------------

    def arm(
        self,
        marker: bytes,
        *,
        until: bytes = b"",
        hold: bool = False,
        times: int = 1,
        request: bool = False,
    ) -> None:
        """Spoil the next *times* requests that contain *marker* (in place of what was armed).

        The request reaches the server, and the reply on its connection is swallowed until
        *until* has been seen in it (for PostgreSQL, ReadyForQuery: the statement committed);
        then both sides of the connection are reset, or with *hold* the connection stays open
        and the reply never comes (the client times out). With *request* the request itself is
        dropped and the client's connection reset: the server never ran it.
        """
        with self._lock:
            self._cuts = [_Cut(marker, until, hold, request, times)]

    def cut_reply(self, marker: bytes) -> None:
        """Besides what is armed: let the next request containing *marker* through, then drop
        its reply and reset the connection."""
        with self._lock:
            self._cuts.append(_Cut(marker))

    def up(self) -> None:
        """Accept connections (again, on the same port)."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self, *, reset: bool = True) -> None:
        """Refuse new connections and reset the live ones (or, without *reset*, end them with
        a FIN each way, as a server that went away cleanly)."""
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if reset:
            self.reset()
            return
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.end()

    close = down

    def reset(self) -> None:
        """Reset every live connection (the clients see ECONNRESET)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.reset()

    # -- forwarding ------------------------------------------------------------------------------

    def _take_cut(self, data: bytes) -> _Cut | None:
        with self._lock:
            for index, cut in enumerate(self._cuts):
                if cut.marker in data:
                    cut.times -= 1
                    if cut.times <= 0:
                        del self._cuts[index]
                    self.cut.set()
                    return cut
        return None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                slow = self.accepted > self.prompt_connects and self.connect_delay > 0
                response = self._responses.popleft() if self._responses else None
            if slow:
                threading.Thread(
                    target=self._open, args=(listener, client, response, True), daemon=True
                ).start()
            else:
                self._open(listener, client, response, False)

    def _open(
        self, listener: socket.socket, client: socket.socket, response: str | None, slow: bool
    ) -> None:
        if slow:
            time.sleep(self.connect_delay)
        try:
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
        except OSError:
            _reset(client)
            return
        link = _Link(client, server, response)
        with self._lock:
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
            while data := link.client.recv(1 << 20):
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
                cut = self._take_cut(data)
                if cut is not None and cut.request:
                    with self._lock:
                        self.cuts += 1
                    _drop(link.client)
                    break
                if cut is not None:
                    link.cut = cut
                link.server.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                link.server.shutdown(socket.SHUT_WR)

    def _replies(self, link: _Link) -> None:
        if link.response is not None:
            self._spoil_response(link, link.response)
            return
        swallowed = b""
        counted = False
        try:
            while data := link.server.recv(1 << 20):
                cut = link.cut
                if cut is None:
                    link.client.sendall(data)
                    continue
                swallowed += data
                if cut.until in swallowed:
                    if not counted:
                        counted = True
                        with self._lock:
                            self.cuts += 1
                    if cut.hold:  # the reply never comes, the connection stays open
                        continue
                    link.reset()
                    return
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                link.client.shutdown(socket.SHUT_WR)

    def _spoil_response(self, link: _Link, fault: str) -> None:
        received = b""
        try:
            while b"\r\n\r\n" not in received or len(received) < self._http_cut(received):
                data = link.server.recv(65536)
                if not data:
                    break
                received += data
            link.client.sendall(received[: self._http_cut(received)])
            with self._lock:
                self.cuts += 1
            if fault == "reset":
                _abort(link.client)
                return
            while link.server.recv(65536):  # "stall": the rest of the reply goes nowhere
                pass
        except OSError:
            pass

    def _http_cut(self, received: bytes) -> int:
        """Where a faulty HTTP reply stops: the end of its headers plus ``body_bytes``."""
        end = received.find(b"\r\n\r\n")
        return len(received) + 1 if end < 0 else end + 4 + self.body_bytes
