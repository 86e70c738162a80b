"""A redis-server of the campaign's own, on a loopback port of its range, that it may restart.

Append-only with fsync on every write: a restart (SIGKILL, then start again) keeps every
acknowledged write, as a production Redis that holds idempotency records must.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time

PORTS = range(24500, 26000)
"""Loopback ports this campaign may use for servers of its own."""


def free_port(start: int) -> int:
    """The first port of `PORTS` from *start* on that nothing listens on."""
    for port in [*range(start, PORTS.stop), *range(PORTS.start, start)]:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the campaign's range")


class OwnRedis:
    """``redis-server`` on 127.0.0.1:<port>, data in a temporary directory."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.restarts = 0
        self._dir = tempfile.mkdtemp(prefix="oncely-faults-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                self._dir,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_ready()
            self._load_scripts()
        except BaseException:
            self.kill()
            raise

    def _load_scripts(self) -> None:
        """Load oncely's function library, as a server in service has it: a reply cut by a
        fault proxy then hits the function's run, not a "function not found" answer."""
        import redis

        from oncely.stores.redis._scripts import library

        with redis.Redis(port=self.port) as client:
            client.function_load(library()[0], replace=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn,
            ):
                conn.sendall(b"PING\r\n")
                if conn.recv(64).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()
        self._process = None

    def restart(self) -> None:
        """Crash the server (SIGKILL) and start it again on its data."""
        self.kill()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
