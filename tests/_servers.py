"""Servers of a test's own on spare loopback ports: started, killed and restarted at will."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis


def free_port(ports: range, start: int | None = None) -> int:
    """The first port of *ports* from *start* on (by default a start spread by pid, so that
    test runs side by side begin apart) that nothing listens on."""
    if start is None:
        start = ports.start + os.getpid() % len(ports)
    for port in [*range(start, ports.stop), *range(ports.start, start)]:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1}")


class OwnRedis:
    """``redis-server`` on 127.0.0.1:*port* without snapshots, its files in *directory* (a
    temporary one, removed by `close`, when None), started with *options*; *library* loads
    oncely's function library at every start, as a server in service has it."""

    def __init__(
        self, directory: Path | None, *options: str, port: int, library: bool = False
    ) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.options = options
        self.library = library
        self.process: subprocess.Popen[bytes] | None = None
        self._own_directory = directory is None
        self.directory = (
            Path(tempfile.mkdtemp(prefix="oncely-redis-")) if directory is None else directory
        )

    def start(self) -> None:
        """Start the server on its port and files; return once it answers PING."""
        executable = shutil.which("redis-server")
        assert executable, "redis-server is not installed: run scripts/services"
        # fmt: off
        command = [
            executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--daemonize", "no", "--dir", str(self.directory),
            *self.options,
        ]
        # fmt: on
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self._wait_ready()
            if self.library:
                from oncely.stores.redis._scripts import library

                with self.admin() as client:
                    client.function_load(library()[0], replace=True)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):  # not -LOADING
                        return
            except OSError:
                pass
            assert self.process is not None
            assert self.process.poll() is None, f"redis-server on port {self.port} exited at start"
            assert time.monotonic() < deadline, f"redis-server on port {self.port} did not start"
            time.sleep(0.01)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server with *sig* (by default a crash); its files stay for a restart."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(sig)
            self.process.wait(timeout=10)
            self.process = None

    def restart(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server with *sig* and start it again on its files."""
        self.stop(sig)
        self.start()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self.stop()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def admin(self) -> redis.Redis:
        """A client of this server that fails at once when it is down."""
        import redis

        return redis.Redis(port=self.port, retry=None, socket_timeout=5)
