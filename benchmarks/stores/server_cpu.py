"""Redis server CPU per transition: ``usec_per_call`` in ``INFO commandstats``.

    python benchmarks/stores/server_cpu.py --url redis://127.0.0.1:7401/0 --ops 2000

runs one round on the server at *url* with the oncely found on ``PYTHONPATH`` and prints, as
JSON, the server's microseconds per call of each command a transition sent or ran inside its
function (``FCALL``, or ``EVALSHA`` for an oncely of before functions, includes the commands it
runs; they are also counted apart), for:

- ``claim``: the claim of a new key; ``complete``: its complete; ``replay``: a second claim of
  the completed key;
- ``raw GET`` and ``raw SET``: redis-py's ``GET`` of a completed key and ``SET … NX PX`` of a
  new one, the yardsticks of the store benchmark.

``INFO commandstats`` counts every client's commands, so the server must be private to the
round: `private_server` starts one. ``bench_stores.py`` runs these rounds (one child process per
tree and round, so a baseline oncely's scripts are measured in the same run). Beside each
command's ``usec_per_call`` (wall-clock time around the command's execution, which on a
loaded machine includes time the server was scheduled out), it gives the CPU time of the
server's main thread per call (`MAIN_THREAD`), which does not, but which counts all of a
command's work: reading and parsing the request, running it, writing the reply.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

LEASE = datetime.timedelta(seconds=30)
TTL = datetime.timedelta(seconds=300)
FINGERPRINT = "f" * 64
RESULT = b'{"payment_id":"pay_0123456789","status":"captured","amount_cents":1250,"currency":"EUR"}'
TRANSITIONS = ("claim", "complete", "replay", "raw SET", "raw GET")
MAIN_THREAD = "main thread"
"""The key of the server main thread's CPU time per call (``INFO cpu``: user and system time,
so not the time it was scheduled out; all of a command: reading, parsing, running, replying)."""


@contextlib.contextmanager
def private_server(port: int) -> Iterator[str]:
    """A redis-server of its own on 127.0.0.1:*port*, without persistence; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH")
    with tempfile.TemporaryDirectory(prefix="oncely-cpu-") as folder:
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                folder,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            _wait_until_up(url, process)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


def _wait_until_up(url: str, process: subprocess.Popen[bytes]) -> None:
    import redis

    deadline = time.monotonic() + 10
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode} (port taken?)")
        try:
            with redis.Redis.from_url(url, socket_connect_timeout=0.2) as client:
                client.ping()
                return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def one_round(url: str, ops: int) -> dict[str, dict[str, float]]:
    """µs of server time per call of each command, by transition (see the module docstring)."""
    import redis

    import oncely
    from oncely import Acquired, Replay

    admin = redis.Redis.from_url(url)
    store = oncely.open_store(url, namespace="cpu", prefix="oncely-cpu:")
    run = uuid.uuid4().hex[:8]
    keys = [f"{run}-{index}" for index in range(ops)]
    tokens: list[int] = []
    out: dict[str, dict[str, float]] = {}

    def cpu() -> float:
        info: dict[str, Any] = admin.info("cpu")
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])

    def measure(name: str, work: Callable[[], None]) -> None:
        admin.config_resetstat()
        before = cpu()
        work()
        used = cpu() - before
        stats: dict[str, Any] = admin.info("commandstats")
        out[name] = {
            command.removeprefix("cmdstat_").upper(): float(figures["usec"]) / ops
            for command, figures in stats.items()
            if int(figures["calls"]) >= ops  # INFO and CONFIG are not the round's
        }
        out[name][MAIN_THREAD] = used * 1e6 / ops

    def claims() -> None:
        for key in keys:
            answer = store.claim(key, FINGERPRINT, lease=LEASE, ttl=TTL)
            assert isinstance(answer, Acquired)
            tokens.append(answer.token)

    def completes() -> None:
        for key, token in zip(keys, tokens, strict=True):
            assert store.complete(key, token, RESULT, ttl=TTL) is None

    def replays() -> None:
        for key in keys:
            assert isinstance(store.claim(key, FINGERPRINT, lease=LEASE, ttl=TTL), Replay)

    raw = [f"oncely-cpu-raw:{key}" for key in keys]

    def raw_sets() -> None:
        for key in raw:
            admin.set(key, RESULT, nx=True, px=30_000)

    def raw_gets() -> None:
        for key in raw:
            admin.get(key)

    try:
        store.claim(f"{run}-warm", FINGERPRINT, lease=LEASE, ttl=TTL)  # loads the library
        # The raw SETs write the keys the raw GETs read.
        for name, work in zip(
            TRANSITIONS, (claims, completes, replays, raw_sets, raw_gets), strict=True
        ):
            measure(name, work)
    finally:
        store.close()
        for pattern in ("oncely-cpu:*", "oncely-cpu-raw:*"):
            names = list(admin.scan_iter(match=pattern, count=1000))
            for start in range(0, len(names), 500):
                admin.delete(*names[start : start + 500])
        admin.close()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--url", required=True, help="a private Redis server's URL")
    parser.add_argument("--ops", type=int, default=2000, help="calls of each transition")
    args = parser.parse_args(argv)
    print(json.dumps(one_round(args.url, args.ops)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
