"""A stdlib TCP proxy in front of a real server, to take the store away and bring it back."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class TcpProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target>; `down` refuses and cuts connections."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> TcpProxy:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        """Accept connections again (on the same port)."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            listener.settimeout(0.05)
            self._listener = listener
            self._stop.clear()
            self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
            self._thread.start()

    def down(self) -> None:
        """Refuse new connections and reset the live ones: the server is unreachable."""
        with self._lock:
            listener, self._listener = self._listener, None
            thread, self._thread = self._thread, None
            connections, self._connections = self._connections, []
        self._stop.set()
        if thread is not None:
            thread.join()
        if listener is not None:
            listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self.down()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
