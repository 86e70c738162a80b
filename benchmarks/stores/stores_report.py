"""The store benchmark's Markdown report (`bench_stores.py` writes it)."""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
import platform
import statistics
from collections.abc import Sequence
from typing import Any

from stores_common import (
    ASYNCPG_DECORATED,
    CALL_BUDGET,
    CALLS,
    CONCURRENCY,
    FLOORS,
    MODES,
    OP_LABELS,
    OPS,
    RESULT,
    TARGET_FLOOR,
    TARGET_MEMORY,
    TARGET_SERVER_US,
    TARGET_TIERED,
    TIERED_REPEAT,
    MemoryFigures,
    Results,
    ServerCpu,
    Verdict,
    _n,
    _ratio_cell,
    _us,
    _verdict,
    median_of,
    ratios,
    sql_target,
)


def _tree_label(tree: str) -> str:
    return "oncely (this tree)" if tree == "oncely" else "oncely (baseline)"


def memory_sections(memory: MemoryFigures, verdicts: list[Verdict]) -> list[str]:
    lines = [
        "## Decorator on memory://",
        "",
        "The payment function decorated by `@idempotent` on `memory://` (default policy) and by "
        "the dict-based reference decorator of the hot-path issue (it binds the signature, "
        "fingerprints the arguments with JSON and SHA-256, keeps records in a dict under a "
        "lock: `benchmarks/stores/hotpath.py`), one worker; a new key is a first call, a "
        f"replay a second call of the same key. {len(memory.rounds['oncely'])} rounds of "
        f"{memory.ops:,} calls per subject, each round in a process of its own"
        + (
            ", the rounds of the two oncely trees alternating"
            if "baseline" in memory.rounds
            else ""
        )
        + ". µs per call are medians over the rounds; the ratio is reference µs / oncely µs "
        "per round (median, interquartile range in brackets).",
        "",
        "| subject | call | reference µs | oncely µs | oncely/reference (IQR) | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for tree, rounds in memory.rounds.items():
        for what in CALLS:
            mine = [each[f"oncely {what}"] for each in rounds]
            ref = [each[f"reference {what}"] for each in rounds]
            per_round = [r / m for r, m in zip(ref, mine, strict=True)]
            target = TARGET_MEMORY[what.split()[1]]
            value = statistics.median(per_round)
            if tree == "oncely":
                verdicts.append(Verdict(f"memory://, {what}: oncely/reference", value, target))
            lines.append(
                f"| {_tree_label(tree)} | {what} | {statistics.median(ref):.1f} "
                f"| {statistics.median(mine):.1f} | {_ratio_cell(per_round, 3)} "
                f"| ≥ {target:g}: {_verdict(value, target)} |"
            )
    lines += [
        "",
        "## Python calls per decorated call",
        "",
        "Counted with `sys.setprofile` over one call of the decorated function on `memory://` "
        "(its own call included; a generator resumed counts as a call), after warm-up. "
        "`tests/decorator/test_call_budget.py` pins the counts of this tree.",
        "",
        "| subject | call | Python calls | C calls | budget |",
        "|---|---|---:|---:|---|",
    ]
    for tree, calls in memory.calls.items():
        for what in CALLS:
            python, c = calls[what]
            budget = CALL_BUDGET[what.split()[1]]
            lines.append(
                f"| {_tree_label(tree)} | {what} | {python} | {c} "
                f"| ≤ {budget}: {'met' if python <= budget else '**MISSED**'} |"
            )
    lines += ["", *stage_table(memory.stages), ""]
    return lines


def stage_table(samples: list[dict[str, float]]) -> list[str]:
    from hotpath import STAGES

    lines = [
        "## µs per stage per call",
        "",
        "The steps of the straight line a decorated call runs on `memory://`, taken one by one "
        "with a clock read between them (`hotpath.stages`: the medians over the calls of a "
        "round, then over the rounds). The total is that of the steps so timed; the whole "
        "decorated call, timed apart, is in the table above (the difference is the wrapper "
        "itself: the switches, the closure that calls the function).",
        "",
        "| stage | what | sync new | async new | sync replay | async replay |",
        "|---|---|---:|---:|---:|---:|",
    ]
    named = dict(STAGES["new"] + STAGES["replay"])

    def cell(key: str) -> str:
        values = [each[key] for each in samples if key in each]
        return f"{statistics.median(values):.2f}" if values else ""

    for stage, what in named.items():
        lines.append(
            f"| {stage} | {what} | {cell(f'sync new {stage}')} | {cell(f'async new {stage}')} "
            f"| {cell(f'sync replay {stage}')} | {cell(f'async replay {stage}')} |"
        )
    lines.append(
        f"| total | | {cell('sync new total')} | {cell('async new total')} "
        f"| {cell('sync replay total')} | {cell('async replay total')} |"
    )
    return lines


def server_cpu_section(cpu: ServerCpu, verdicts: list[Verdict]) -> list[str]:
    from server_cpu import MAIN_THREAD, TRANSITIONS

    lines = [
        "## Redis server CPU per transition",
        "",
        f"`usec_per_call` in `INFO commandstats` of a private `redis-server` {cpu.version} "
        "started for the run (no other client), after `CONFIG RESETSTAT`: each round makes "
        f"{cpu.ops:,} claims of new keys, their completes, then {cpu.ops:,} claims of the "
        "completed keys (replays), and the raw yardsticks: redis-py's `SET … NX PX` of new keys "
        "and `GET`s of them (`benchmarks/stores/server_cpu.py`, one process per tree and round"
        + (", the two oncely trees alternating" if "baseline" in cpu.rounds else "")
        + f"). Medians over {len(cpu.rounds.get('oncely', []))} rounds, with the lowest and "
        "highest round in brackets. A function's (or script's) time includes the commands it runs "
        "inside, "
        "which the last column lists (each counted apart by Redis as well). `commandstats` "
        "times are wall-clock time in the server's main thread: on a loaded machine they "
        "include time the server was scheduled out, so compare rows of one run, never runs. "
        "The main thread's CPU time per call (`INFO cpu`, user + system) is not inflated by "
        "scheduling, but counts all of a command's work: reading the request, running it, "
        "writing the reply.",
        "",
        "| subject | transition | command | server µs per call | commands inside, µs each "
        f"| main thread CPU µs per call | target ≤ {TARGET_SERVER_US:g} µs |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for tree, rounds in cpu.rounds.items():
        for transition in TRANSITIONS:
            found = [each[transition] for each in rounds if transition in each]
            if not found:
                continue
            calls = [command for command in ("FCALL", "EVALSHA") if command in found[0]]
            main = calls[0] if calls else next(iter(found[0]))
            values = [each.get(main, 0.0) for each in found]
            value = statistics.median(values)
            apart = (main, MAIN_THREAD)
            inside = sorted({command for each in found for command in each if command not in apart})
            thread = [each[MAIN_THREAD] for each in found if MAIN_THREAD in each]
            thread_cell = f"{statistics.median(thread):.1f}" if thread else "-"
            inner = ", ".join(
                f"`{command}` {statistics.median(each.get(command, 0.0) for each in found):.1f}"
                for command in inside
            )
            target = ""
            if not transition.startswith("raw"):
                target = f"{'met' if value <= TARGET_SERVER_US else '**MISSED**'}"
                if tree == "oncely":
                    verdicts.append(
                        Verdict(
                            f"Redis server CPU, {transition}: µs per call",
                            value,
                            TARGET_SERVER_US,
                            at_most=True,
                        )
                    )
            lines.append(
                f"| {_tree_label(tree)} | {transition} | `{main}` | {value:.1f} "
                f"({min(values):.1f}-{max(values):.1f}) | {inner} | {thread_cell} | {target} |"
            )
    return [*lines, ""]


def sql_method_note(stores: Sequence[str]) -> list[str]:
    """How the SQLite rows and the SQL stores' `@idempotent` rows are measured."""
    lines = []
    if any(store == "PostgreSQL" or store.startswith("SQLite") for store in stores):
        lines.append(
            "The `@idempotent` rows of PostgreSQL and SQLite are the payment function decorated "
            "with the default policy (x1, sync, and async with an async function), in the same "
            "rounds as the store verbs and the raw driver."
        )
    if any(store.startswith("SQLite") for store in stores):
        lines.append(
            "Raw SQLite is sqlite3 doing the same transactions as the store: `INSERT … ON "
            "CONFLICT DO NOTHING RETURNING` then `UPDATE` (cycle) and `SELECT` (replay), each in "
            "autocommit mode (a transaction of its own), on a table made from oncely's schema, "
            "in WAL mode with the same `synchronous` setting, a connection per thread and this "
            "process's writers queued on a lock, as the store queues them; its async rows run "
            "the same calls inline on the event loop (the floor: no hop to a thread). The files "
            "are in a temporary folder of the run."
        )
    return [*lines, ""] if lines else []


def fastest_floor(results: Results, store: str, mode: str, op: str) -> str | None:
    """The floor of *mode* with the highest median throughput for *op* (``None``: no floor)."""
    found = [
        (median_of(samples, "ops_per_s"), floor)
        for floor in FLOORS
        if (samples := results.get(store, mode, op, floor))
    ]
    return max(found)[1] if found else None


def sql_decorator_section(results: Results, store: str) -> list[str]:
    """The `@idempotent` rows of a SQL store (x1), beside its store verbs, the raw driver and
    the floors."""
    subjects = ("raw", *FLOORS, "oncely", "oncely @idempotent", ASYNCPG_DECORATED)
    if not results.get(store, MODES[0], "cycle", "oncely @idempotent"):
        return []
    lines = [
        f"### {store}: decorated function, x1",
        "",
        "The payment function decorated by `@idempotent` (default policy: JSON codec, "
        "fingerprint of all arguments, heartbeat; sync, and async with an async function) on "
        "this store, next to the store verbs, the raw driver and (PostgreSQL) the floors of "
        "the same rounds. A floor is the driver's cheapest honest way to make the raw "
        "reference's round trips: one plain connection, statements prepared on the server "
        "(psycopg's `prepare=True` on a kept cursor; asyncpg's statement cache), one sequential "
        "worker (`benchmarks/stores/floors.py`). On PostgreSQL, async, the same function on a "
        'store whose async verbs run on asyncpg (`async_driver="asyncpg"`) as well.',
        "",
        "| mode | operation | subject | ops/s | p50 µs | p99 µs | ratio to raw (IQR) "
        "| ratio to psycopg floor | ratio to asyncpg floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, op in itertools.product((MODES[0], MODES[2]), OPS):
        raw = results.get(store, mode, op, "raw")
        floors = [results.get(store, mode, op, floor) for floor in FLOORS]
        for subject in subjects:
            samples = results.get(store, mode, op, subject)
            if not samples:
                continue
            label = {"oncely": "oncely store verbs", "raw": raw_label(store)}.get(subject, subject)
            to_floors = " | ".join(
                _ratio_cell(ratios(samples, floor)) if floor else "-" for floor in floors
            )
            lines.append(
                f"| {mode} | {OP_LABELS[op]} | {label} "
                f"| {_n(median_of(samples, 'ops_per_s'))} | {_us(median_of(samples, 'p50_us'))} "
                f"| {_us(median_of(samples, 'p99_us'))} | {_ratio_cell(ratios(samples, raw))} "
                f"| {to_floors} |"
            )
    return [*lines, ""]


def raw_label(store: str) -> str:
    """The raw reference's name in a table: on Redis it is the floor as well."""
    if store.startswith("Redis"):
        return "raw = floor (pooled redis-py, hiredis)" if _hiredis() else "raw (no hiredis)"
    return "raw (pool)" if store == "PostgreSQL" else "raw"


def _hiredis() -> bool:
    try:
        importlib.metadata.version("hiredis")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def sql_decorator_verdicts(results: Results, store: str, verdicts: list[Verdict]) -> None:
    """The targets of the decorator rows (`sql_target`; `TARGET_FLOOR` over the fastest
    floor)."""
    for mode, op in itertools.product((MODES[0], MODES[2]), OPS):
        raw = results.get(store, mode, op, "raw")
        mine = results.get(store, mode, op, "oncely @idempotent")
        if raw and mine:
            value = statistics.median(ratios(mine, raw))
            target = sql_target(store, op)
            verdicts.append(Verdict(f"{store}, {mode}, {op}: @idempotent/raw", value, target))
        floor = fastest_floor(results, store, mode, op)
        if floor is not None and mine:
            value = statistics.median(ratios(mine, results.get(store, mode, op, floor)))
            verdicts.append(
                Verdict(f"{store}, {mode}, {op}: @idempotent/{floor}", value, TARGET_FLOOR[mode])
            )
        on_asyncpg = results.get(store, mode, op, ASYNCPG_DECORATED)
        if floor is not None and on_asyncpg:
            value = statistics.median(ratios(on_asyncpg, results.get(store, mode, op, floor)))
            verdicts.append(
                Verdict(
                    f"{store}, {mode}, {op}: @idempotent on asyncpg/{floor}",
                    value,
                    TARGET_FLOOR[mode],
                )
            )


# -- the report --------------------------------------------------------------------------------


def machine() -> list[str]:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as info:
        memory = f"{int(info.readline().split()[1]) // 1024 // 1024} GiB RAM"
    return [
        f"{platform.system()} {platform.release()} {platform.machine()}, CPU: {cpu}, "
        f"{os.cpu_count()} cores, {memory}",
        f"Python {platform.python_version()} ({platform.python_implementation()})",
    ]


def package_versions() -> str:
    names = ["oncely", "redis", "hiredis", "psycopg", "psycopg-binary", "psycopg-pool"]
    names.append("aws-lambda-powertools")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            if name == "hiredis":
                found.append("no hiredis (redis-py's pure-Python parser)")
    return ", ".join(found)


def store_table(results: Results, store: str, verdicts: list[Verdict]) -> list[str]:
    lines = [
        "| mode | operation | raw ops/s | raw p50 µs | raw p99 µs | oncely ops/s "
        "| oncely p50 µs | oncely p99 µs | oncely/raw (IQR) | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        for op in OPS:
            raw = results.get(store, mode, op, "raw")
            mine = results.get(store, mode, op, "oncely")
            if not raw or not mine:
                continue
            per_round = ratios(mine, raw)
            value = statistics.median(per_round)
            target = sql_target(store, op)
            verdicts.append(Verdict(f"{store}, {mode}, {op}: oncely/raw", value, target))
            lines.append(
                f"| {mode} | {OP_LABELS[op]} "
                f"| {_n(median_of(raw, 'ops_per_s'))} | {_us(median_of(raw, 'p50_us'))} "
                f"| {_us(median_of(raw, 'p99_us'))} "
                f"| {_n(median_of(mine, 'ops_per_s'))} | {_us(median_of(mine, 'p50_us'))} "
                f"| {_us(median_of(mine, 'p99_us'))} "
                f"| {_ratio_cell(per_round)} | ≥ {target:g}: {_verdict(value, target)} |"
            )
    return lines


def tiered_table(results: Results, verdicts: list[Verdict]) -> list[str]:
    lines = [
        "| mode | raw GET ops/s | raw p50 µs | raw p99 µs | tiered replay ops/s "
        "| tiered p50 µs | tiered p99 µs | tiered/raw GET (IQR) | target ≥ 20x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        raw = results.get("Redis", mode, "replay", "raw")
        tiered = results.get("Redis", mode, "replay", "oncely tiered")
        if not raw or not tiered:
            continue
        per_round = ratios(tiered, raw)
        value = statistics.median(per_round)
        verdicts.append(Verdict(f"Redis, {mode}: tiered replay / raw GET", value, TARGET_TIERED))
        lines.append(
            f"| {mode} | {_n(median_of(raw, 'ops_per_s'))} | {_us(median_of(raw, 'p50_us'))} "
            f"| {_us(median_of(raw, 'p99_us'))} | {_n(median_of(tiered, 'ops_per_s'))} "
            f"| {_us(median_of(tiered, 'p50_us'))} | {_us(median_of(tiered, 'p99_us'))} "
            f"| {_ratio_cell(per_round, 1)} | {_verdict(value, TARGET_TIERED)} |"
        )
    return lines


def decorator_table(results: Results) -> list[str]:
    subjects = ["raw", "oncely", "oncely @idempotent", "Powertools idempotent_function"]
    if not results.get("Redis", MODES[0], "cycle", subjects[2]):
        return []
    lines = [
        "| mode | operation | subject | round trips | ops/s | p50 µs | p99 µs "
        "| ratio to raw (IQR) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    trips = {
        ("cycle", "raw"): "2",
        ("cycle", "oncely"): "2",
        ("cycle", "oncely @idempotent"): "2",
        ("cycle", "Powertools idempotent_function"): "2",
        ("replay", "raw"): "1",
        ("replay", "oncely"): "1",
        ("replay", "oncely @idempotent"): "1",
        ("replay", "Powertools idempotent_function"): "3",
    }
    for mode, op in itertools.product((MODES[0], MODES[2]), OPS):
        raw = results.get("Redis", mode, op, "raw")
        for subject in subjects:
            samples = results.get("Redis", mode, op, subject)
            if not samples:
                continue
            label = "oncely store verbs" if subject == "oncely" else subject
            lines.append(
                f"| {mode} | {OP_LABELS[op]} | {label} | {trips[(op, subject)]} "
                f"| {_n(median_of(samples, 'ops_per_s'))} | {_us(median_of(samples, 'p50_us'))} "
                f"| {_us(median_of(samples, 'p99_us'))} | {_ratio_cell(ratios(samples, raw))} |"
            )
    return lines


def decorator_section(results: Results, note: str) -> list[str]:
    lines = ["## Decorated function, Redis, x1 (reference)", ""]
    lines += [f"Note: {each}\n" for each in results.notes.get("Redis", [])]
    table = decorator_table(results)
    if not table:
        return [*lines, f"Not measured: {note or 'Redis was not measured'}"]
    if note:
        lines += [f"Powertools: not measured ({note.split(':')[0]}).", ""]
    return [
        *lines,
        "The same payment function decorated by oncely's `@idempotent` (default policy: JSON "
        "codec, fingerprint of all arguments, heartbeat; sync, and async with an async "
        "function) and (sync) by AWS Powertools' "
        "`idempotent_function` with `CachePersistenceLayer` (its Redis layer: key JMESPath, "
        "in-progress expiry from a stand-in Lambda context, no local cache), next to the store "
        "verbs and the raw driver of the same rounds. Powertools runs without "
        "`payload_validation_jmespath`: its Redis layer drops the payload hash when it "
        "completes a record, so with validation on, every replay fails with "
        "`IdempotencyValidationError` (aws-lambda-powertools 3.37). Its replay costs 3 round "
        "trips: the `SET NX` that fails, then two `GET`s.",
        "",
        *table,
    ]


def render(
    results: Results,
    context: dict[str, Any],
    memory: MemoryFigures | None = None,
    cpu: ServerCpu | None = None,
) -> str:
    verdicts: list[Verdict] = []
    lines = [
        "# Store benchmark",
        "",
        f"Generated by `{context['command']}` on {context['started']} "
        f"({context['elapsed']:.0f} s).",
        "",
        "## Machine",
        "",
        f"- run: `{context['command']}`, {context['started']}, {context['elapsed']:.0f} s",
        *[f"- {line}" for line in context["machine"]],
        f"- servers (loopback): {context['servers']}",
        f"- packages: {context['packages']}",
        f"- load average at start: {context['load_start']}; at the end: {context['load_end']} "
        "(the machine is shared with other work)",
        "",
        "## Method",
        "",
        f"Each subject ran {context['ops']:,} operations per measurement, in "
        f"{context['rounds']} rounds of {context['per_round']:,} interleaved with the other "
        "subjects' (the order rotates each round, so a slow moment of the shared machine falls "
        "on a pair of neighbouring runs), after a warm-up round that fills the pools, loads "
        "the scripts and prepares the statements. A cycle is a claim then a complete of a new "
        "key; a replay is a claim of a key the cycle just completed (its answer carries the "
        f"{len(RESULT)}-byte result). `x1` is one worker; `x{CONCURRENCY}` is {CONCURRENCY} "
        "threads (sync) or asyncio tasks (async) sharing the store, and the same for the raw "
        "driver: redis-py's connection pool (the async client in the event loop), and "
        "`psycopg_pool` pools of oncely's default sizes (1 to 10 connections) with one "
        "checkout per statement. Raw Redis is `SET NX PX` + `SET EX` (cycle) and `GET` "
        "(replay); raw PostgreSQL is `INSERT … ON CONFLICT DO NOTHING RETURNING` + `UPDATE` "
        "(cycle) and `SELECT` (replay) on a table shaped like oncely's. On Redis the raw "
        "reference is also the floor (the driver's cheapest honest way: a pooled redis-py "
        "client with hiredis); on PostgreSQL the floors, measured x1 beside it, are plain "
        "connections with prepared statements (psycopg sync and async, asyncpg). Throughput and "
        "latencies are medians over the rounds; a ratio is the median of the per-round "
        "ratios, with their interquartile range in brackets (its width is the noise). The "
        f"tiered store's timed runs go over their keys {TIERED_REPEAT} times (a replay from "
        "memory takes microseconds).",
        "",
    ]
    lines += sql_method_note(context["stores"])
    if memory is not None:
        lines += memory_sections(memory, verdicts)
    for store in context["stores"]:
        lines += [f"## {store}", ""]
        if store in results.failures:
            lines += [f"Not measured: {results.failures[store]}", ""]
            continue
        lines += [*store_table(results, store, verdicts), ""]
        lines += sql_decorator_section(results, store)
        sql_decorator_verdicts(results, store, verdicts)
    tiered = tiered_table(results, verdicts)
    if len(tiered) > 2:
        lines += [
            "## Tiered store replay (`tiered+redis://`) against the raw Redis `GET`",
            "",
            "The tiered store answers a replay of a cached completed record from process "
            "memory, without a round trip.",
            "",
            *tiered,
            "",
        ]
    if "Redis" in context["stores"]:
        lines += [*decorator_section(results, context.get("powertools_note", "")), ""]
    if cpu is not None:
        lines += server_cpu_section(cpu, verdicts)
    lines += ["## Targets", ""]
    if not verdicts:
        lines.append("- nothing was measured")
    for verdict in verdicts:
        if verdict.at_most:
            met = "met" if verdict.value <= verdict.target else "**MISSED**"
            lines.append(f"- {verdict.what} ≤ {verdict.target:g}: {verdict.value:.1f} ({met})")
            continue
        unit = "x" if verdict.target == TARGET_TIERED else ""
        digits = 3 if verdict.what.startswith("memory") else 2
        lines.append(
            f"- {verdict.what} ≥ {verdict.target:g}{unit}: {verdict.value:.{digits}f}{unit} "
            f"({_verdict(verdict.value, verdict.target)})"
        )
    for store, reason in results.failures.items():
        lines.append(f"- {store}: not measured ({reason.splitlines()[0]})")
    return "\n".join(lines) + "\n"


def _sections(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The lines before the first ``## `` heading, and each section's lines by title."""
    head: list[str] = []
    sections: dict[str, list[str]] = {}
    current = head
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        else:
            current.append(line)
    return head, sections


def merged(earlier: str, report: str) -> str:
    """*report*, with the sections of the *earlier* report it lacks carried over in their
    places (and their lines of the targets), named as such in the Machine section."""
    old_head, old = _sections(earlier)
    head, new = _sections(report)
    carried = [title for title in old if title not in new and title != "Targets"]
    if not carried:
        return report
    measured = {line[2:].split(",")[0] for line in new.get("Targets", []) if line.startswith("- ")}
    measured |= {title for title in new if title != "Targets"}
    targets = [line for line in new.get("Targets", []) if line.strip()]
    targets += [
        line
        for line in old.get("Targets", [])
        if line.startswith("- ") and line[2:].split(",")[0] not in measured
    ]
    earlier_run = next((line for line in old_head if line.startswith("Generated by")), "")
    note = (
        f"- carried over from the earlier report, not measured by this run: "
        f"{', '.join(carried)}. {earlier_run.replace('Generated by', 'That report was made by')}"
    )
    older = next((line for line in old.get("Machine", []) if line.startswith("- carried")), "")
    if older:  # the earlier report carried sections of its own
        note += f" In it, {older[2:]}"
    machine = new.get("Machine", [])
    while machine and not machine[-1].strip():
        machine.pop()
    new["Machine"] = [*machine, note, ""]
    order = [title for title in old if title != "Targets"]
    order += [title for title in new if title not in order and title != "Targets"]
    lines = [*head]
    for title in order:
        lines += [f"## {title}", *(new[title] if title in new else old[title])]
    lines += ["## Targets", "", *targets]
    return "\n".join(lines).rstrip("\n") + "\n"
