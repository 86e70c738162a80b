"""Benchmark the HTTP middleware with wrk against uvicorn on loopback; write a Markdown report.

    python benchmarks/http/run.py                      # every scenario, both workloads
    python benchmarks/http/run.py --rounds 1 --duration 5 --scenarios baseline oncely-memory

Each request carries a unique Idempotency-Key (``unique_keys.lua``), so every request is a
first request: claim, run, complete (the steady-state cost of protection). Scenarios run in
rounds, interleaved, and the report gives each one's median over the rounds, so drift in the
machine's load spreads over all of them. Ratios are to the baseline (no middleware) of the
same workload. Not collected by pytest.

Servers: ``ONCELY_TEST_REDIS_URL`` and ``ONCELY_TEST_POSTGRES_URL`` (or ``--redis-url`` and
``--postgres-url``). The reference packages (idemkit, fastapi-idempotency-key) run under
``--reference-python``, a venv that has them, kept apart from the project's.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ONCELY = ["oncely-memory", "oncely-sqlite", "oncely-redis", "oncely-postgres"]
REFERENCES = ["idemkit-redis", "fastapi-idempotency-key-redis"]
FLOORS = ["floor-redis", "floor-postgres"]
DIRECT = ["oncely-postgres-direct"]
"""oncely with every store call its own (``coalesce=False``): what grouping them costs or saves."""
SCENARIOS = ["baseline", *ONCELY, *REFERENCES, *FLOORS, *DIRECT]
OURS = ["oncely", "starlette", "redis", "psycopg"]
THEIRS = ["idemkit", "fastapi-idempotency-key", "starlette", "redis"]


@dataclass
class Sample:
    """One wrk run."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    errors: int
    cpu_us: float = float("nan")
    """The server process's CPU time per request (user + system), in µs."""


@dataclass
class Result:
    """Every round of one scenario under one workload."""

    samples: list[Sample] = field(default_factory=list)
    failure: str = ""

    def median(self, name: str) -> float:
        return statistics.median(getattr(sample, name) for sample in self.samples)


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def parse_wrk(output: str) -> Sample:
    """Read req/s, p50, p99 and error counts from ``wrk --latency`` output."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    latency = {
        pct: _ms(value, unit)
        for pct, value, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M)
    }
    requests = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    return Sample(
        rps,
        latency.get("50", float("nan")),
        latency.get("99", float("nan")),
        requests,
        int(non_2xx.group(1)) if non_2xx else 0,
        sum(int(n) for n in errors.groups()) if errors else 0,
    )


class Server:
    """One scenario's uvicorn process."""

    def cpu_seconds(self) -> float:
        """The CPU time (user + system) the server process has used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __init__(self, python: str, scenario: str, work: float, args: argparse.Namespace) -> None:
        command = [
            python, str(HERE / "app.py"), scenario, "--work", str(work),
            "--sqlite-path", str(args.tmp / f"{uuid.uuid4().hex[:8]}.db"),
            "--redis-url", args.redis_url, "--postgres-url", args.postgres_url,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=args.tmp
        )
        self.url = self._wait()

    def _wait(self) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.2)
            if ready:
                found = re.search(r"listening on (http://\S+)", self.process.stdout.readline())
                if found:
                    return found.group(1)
            if self.process.poll() is not None:
                assert self.process.stderr is not None
                raise RuntimeError(self.process.stderr.read().strip()[-800:])
        raise RuntimeError("the server did not start in 60 s")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def wrk(url: str, seconds: float, args: argparse.Namespace) -> str:
    command = [
        "wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{seconds:g}s", "--latency",
        "-s", str(HERE / "unique_keys.lua"), url, "--", uuid.uuid4().hex[:12],
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def measure(python: str, scenario: str, work: float, args: argparse.Namespace) -> Sample:
    server = Server(python, scenario, work, args)
    try:
        if args.warmup:
            wrk(server.url, args.warmup, args)
        cpu = server.cpu_seconds()
        sample = parse_wrk(wrk(server.url, args.duration, args))
        sample.cpu_us = (server.cpu_seconds() - cpu) / max(sample.requests, 1) * 1e6
        return sample
    finally:
        server.stop()


def machine() -> list[str]:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with open("/proc/meminfo") as info:
        memory = f"{int(info.readline().split()[1]) // 1024 // 1024} GiB RAM"
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()
    return [
        f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs "
        f"({cpu}), {memory}",
        f"Python {platform.python_version()}, uvicorn (h11, asyncio loop), 1 worker; "
        f"{(wrk_version or ['wrk'])[0].strip()}",
        f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
        "(the machine is shared; see the note below)",
    ]


def versions(python: str, packages: list[str]) -> str:
    code = (
        "import importlib.metadata as m\n"
        f"print(', '.join(f'{{p}} {{m.version(p)}}' for p in {packages!r}))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def report(results: dict[tuple[str, float], Result], args: argparse.Namespace, started: str) -> str:
    command = " ".join(["python", "benchmarks/http/run.py", *args.argv])
    lines = [
        "# HTTP middleware benchmark",
        "",
        f"Generated by `{command}` on {started}.",
        "",
        "## Machine",
        "",
        f"- run: `{command}`, {started}",
        *[f"- {line}" for line in args.machine],
        f"- load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        f"- project venv: {versions(sys.executable, OURS)}",
        f"- reference venv: {versions(args.reference_python, THEIRS)}",
        "",
        "## Method",
        "",
        f"`wrk -t{args.threads} -c{args.connections} -d{args.duration:g}s --latency -s "
        "benchmarks/http/unique_keys.lua` against uvicorn on 127.0.0.1, after a "
        f"{args.warmup:g} s warm-up on the same server. Every request is `POST /payments` "
        "with a small JSON body and an `Idempotency-Key` no other request uses, so each one "
        "is claimed, run, stored. The app is the same Starlette endpoint in every scenario "
        "(`benchmarks/http/app.py`); only the middleware differs. Redis and PostgreSQL are the "
        "local servers (loopback). Scenarios run interleaved, "
        f"{args.rounds} round(s); each figure is the median over the rounds. The ratio is "
        "req/s over the baseline's req/s in the same workload. *CPU µs/req* is the server "
        "process's CPU time (user + system, from `/proc`) over the requests it served: what "
        "one request costs the server whatever else the machine runs; *CPU ratio* is the "
        "baseline's CPU µs/req over the scenario's, the req/s ratio a CPU-bound server would "
        "reach on an otherwise idle machine.",
        "",
    ]
    for work in args.works:
        title = f"{work * 1000:g} ms simulated work" if work else "no work"
        base = results.get(("baseline", work))
        base_rps = base.median("rps") if base and base.samples else float("nan")
        base_cpu = base.median("cpu_us") if base and base.samples else float("nan")
        lines += [
            f"## {title}, {args.connections} connections",
            "",
            "| scenario | req/s | p50 ms | p99 ms | ratio to baseline | CPU µs/req | CPU ratio "
            "| non-2xx | socket errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for scenario in args.scenarios:
            result = results.get((scenario, work))
            if result is None:
                continue
            if not result.samples:
                lines.append(f"| {scenario} | not run: {result.failure} | | | | | | | |")
                continue
            rps = result.median("rps")
            cpu = result.median("cpu_us")
            lines.append(
                f"| {scenario} | {rps:,.0f} | {result.median('p50_ms'):.1f} | "
                f"{result.median('p99_ms'):.1f} | {rps / base_rps:.2f} | {cpu:.0f} | "
                f"{base_cpu / cpu:.2f} | {sum(s.non_2xx for s in result.samples)} | "
                f"{sum(s.errors for s in result.samples)} |"
            )
        lines.append("")
        lines += _targets(results, work, base_rps, base_cpu)
    return "\n".join(lines) + "\n"


MEMORY_TARGET = 0.7
"""No work: oncely on memory:// at this fraction of the bare app's req/s at least (issue #12)."""
REDIS_TARGET = 2.0
"""No work: oncely on Redis at this multiple of the best reference package's req/s at least."""
WORK_TARGET = 0.97
"""50 ms of work: every oncely store at this fraction of the bare app's req/s at least."""


def _targets(
    results: dict[tuple[str, float], Result], work: float, base: float, base_cpu: float
) -> list[str]:
    def median(scenario: str, name: str) -> float | None:
        result = results.get((scenario, work))
        return result.median(name) if result and result.samples else None

    def verdict(value: float, target: float) -> str:
        return "met" if value >= target else "MISSED"

    out = ["Targets (req/s; in brackets the same from CPU µs/req, see the method):", ""]
    if work:
        for scenario in ONCELY:
            value, cpu = median(scenario, "rps"), median(scenario, "cpu_us")
            if value is not None and cpu is not None:
                out.append(
                    f"- {scenario} >= {WORK_TARGET} x baseline: {value / base:.3f} "
                    f"({verdict(value / base, WORK_TARGET)}) [{base_cpu / cpu:.3f}]"
                )
    else:
        memory, cpu = median("oncely-memory", "rps"), median("oncely-memory", "cpu_us")
        if memory is not None and cpu is not None:
            out.append(
                f"- oncely-memory >= {MEMORY_TARGET} x baseline: {memory / base:.2f} "
                f"({verdict(memory / base, MEMORY_TARGET)}) [{base_cpu / cpu:.2f}]"
            )
        references = [
            (value, median(s, "cpu_us") or math.nan)
            for s in REFERENCES
            if (value := median(s, "rps")) is not None
        ]
        ours, ours_cpu = median("oncely-redis", "rps"), median("oncely-redis", "cpu_us")
        if references and ours is not None and ours_cpu is not None:
            best = max(value for value, _ in references)
            fastest_cpu = min(cpu for _, cpu in references)
            out.append(
                f"- oncely-redis >= {REDIS_TARGET:g} x the best reference on Redis "
                f"({best:,.0f} req/s): {ours / best:.2f} x ({verdict(ours / best, REDIS_TARGET)})"
                f" [{fastest_cpu / ours_cpu:.2f} x the reference with the least CPU µs/req]"
            )
    for backend in ("redis", "postgres"):
        ours, ours_cpu = median(f"oncely-{backend}", "rps"), median(f"oncely-{backend}", "cpu_us")
        floor, floor_cpu = median(f"floor-{backend}", "rps"), median(f"floor-{backend}", "cpu_us")
        if ours is None or ours_cpu is None or floor is None or floor_cpu is None:
            continue
        out.append(
            f"- floor: oncely-{backend} at {ours / floor:.2f} of floor-{backend}'s req/s "
            f"[{floor_cpu / ours_cpu:.2f} of its CPU µs/req] (the same two round trips by hand)"
        )
        peers = [value for s in REFERENCES if (value := median(s, "rps")) is not None]
        peers_cpu = [value for s in REFERENCES if (value := median(s, "cpu_us")) is not None]
        if backend == "redis" and not work and peers and peers_cpu:
            wanted = REDIS_TARGET * max(peers)
            budget = min(peers_cpu) / REDIS_TARGET
            out.append(
                f"- {REDIS_TARGET:g} x the best reference is {wanted:,.0f} req/s: "
                f"{wanted / floor:.2f} x floor-redis, {wanted / base:.2f} x the bare app "
                f"[a CPU-bound server gets there at {budget:.0f} CPU µs/req: floor-redis takes "
                f"{floor_cpu:.0f}, the bare app {base_cpu:.0f}]"
            )
    for direct in DIRECT:
        grouped = direct.removesuffix("-direct")
        ours, ours_cpu = median(grouped, "rps"), median(grouped, "cpu_us")
        alone, alone_cpu = median(direct, "rps"), median(direct, "cpu_us")
        if ours is None or ours_cpu is None or alone is None or alone_cpu is None:
            continue
        out.append(
            f"- grouping: {grouped} at {ours / alone:.2f} of {direct}'s req/s "
            f"[{alone_cpu / ours_cpu:.2f} of its CPU µs/req] (the same middleware with every "
            "store call its own, none grouped into a batch call)"
        )
    return [*out, ""]


def _postgres_schema(base: str) -> tuple[str, str]:
    sys.path.insert(0, str(ROOT / "src"))
    import oncely

    schema = f"oncely_bench_{uuid.uuid4().hex[:8]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with oncely.open_store(url) as store:  # type: ignore[attr-defined]
        store.migrate()
    return url, schema


def _drop_schema(base: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    parser.add_argument("--works", nargs="+", type=float, default=[0.05, 0.0])
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--redis-url", default=os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--postgres-url", default=os.environ.get("ONCELY_TEST_POSTGRES_URL", ""))
    parser.add_argument("--reference-python", default=sys.executable)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "http.md")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install -y --no-upgrade wrk")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.machine = machine()
    schema = None
    base_postgres = args.postgres_url
    if {"oncely-postgres", "floor-postgres", *DIRECT} & set(args.scenarios) and base_postgres:
        args.postgres_url, schema = _postgres_schema(base_postgres)
    results: dict[tuple[str, float], Result] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="oncely-bench-") as tmp:
            args.tmp = Path(tmp)
            for round_number in range(1, args.rounds + 1):
                for work in args.works:
                    for scenario in args.scenarios:
                        result = results.setdefault((scenario, work), Result())
                        if result.failure:
                            continue
                        python = args.reference_python if scenario in REFERENCES else sys.executable
                        try:
                            sample = measure(python, scenario, work, args)
                        except (RuntimeError, subprocess.CalledProcessError) as exc:
                            result.failure = (str(exc) or repr(exc)).splitlines()[-1][:160]
                            print(f"{scenario}: not run: {result.failure}", file=sys.stderr)
                            continue
                        result.samples.append(sample)
                        print(
                            f"round {round_number} work {work:g}s {scenario:32} "
                            f"{sample.rps:9,.0f} req/s  p50 {sample.p50_ms:7.1f} ms  "
                            f"p99 {sample.p99_ms:7.1f} ms  non-2xx {sample.non_2xx}",
                            file=sys.stderr,
                        )
    finally:
        if schema is not None:
            _drop_schema(base_postgres, schema)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report(results, args, started))
    print(args.output.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
