"""A stdlib TCP proxy that cuts chosen HTTP responses while their body travels."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterable

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class ResponseFaultProxy:
    """Forwards 127.0.0.1:<port> to a loopback server; spoils the responses of chosen connections.

    Each accepted connection takes the next fault from *faults*, and passes through untouched
    once they run out. A faulty connection forwards the request whole, and the server's reply
    up to the end of its headers plus *body_bytes* of body; then ``"stall"`` forwards nothing
    more (the client's read times out), and ``"reset"`` resets the client's connection.
    """

    def __init__(self, target_port: int, faults: Iterable[str], *, body_bytes: int = 8) -> None:
        self.target_port = target_port
        self.faults = deque(faults)
        self.body_bytes = body_bytes
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ResponseFaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = [self._listener, *self._sockets], []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self.accepted += 1
                fault = self.faults.popleft() if self.faults else None
                self._sockets += [client, server]
            threading.Thread(target=_pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._reply, args=(server, client, fault), daemon=True).start()

    def _reply(self, server: socket.socket, client: socket.socket, fault: str | None) -> None:
        if fault is None:
            _pump(server, client)
            return
        received = b""
        try:
            while b"\r\n\r\n" not in received or len(received) < _cut(received, self.body_bytes):
                data = server.recv(65536)
                if not data:
                    break
                received += data
            client.sendall(received[: _cut(received, self.body_bytes)])
            if fault == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
                client.close()
                return
            while server.recv(65536):  # "stall": the rest of the reply goes nowhere
                pass
        except OSError:
            pass


def _cut(received: bytes, body_bytes: int) -> int:
    """Where a faulty reply stops: the end of its headers plus *body_bytes*."""
    end = received.find(b"\r\n\r\n")
    return len(received) + 1 if end < 0 else end + 4 + body_bytes


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
