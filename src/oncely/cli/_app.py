"""The click application behind ``oncely``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import click

import oncely
from oncely._core.codec import decode_outcome
from oncely._core.keys import scope_key
from oncely._core.records import Record, Status


class NotFoundError(click.ClickException):
    """The key has no live record."""

    exit_code = 1


class SetupError(click.ClickException):
    """Bad options, a missing extra, or a schema that needs `oncely migrate`."""

    exit_code = 2


class UnavailableError(click.ClickException):
    """The store could not be reached: try again later."""

    exit_code = 3


class FailedError(click.ClickException):
    """The store failed the operation (a corrupt record, a rejected command)."""

    exit_code = 4


def _translate(exc: oncely.OncelyError) -> click.ClickException:
    if isinstance(exc, oncely.StoreUnavailableError):
        return UnavailableError(f"store unavailable: {exc}")
    if isinstance(exc, oncely.SchemaMissingError):
        return SetupError(f"{exc} (run `oncely migrate`)")
    if isinstance(exc, (oncely.ConfigurationError, oncely.MissingDependencyError)):
        return SetupError(str(exc))
    return FailedError(str(exc))


def _open(ctx: click.Context) -> Any:
    url = ctx.obj.get("store_url")
    if not url:
        raise SetupError(f"no store: pass --store URL or set {ENV_STORE_URL}")
    options: dict[str, Any] = {"namespace": ctx.obj["namespace"]}
    if url.startswith("sqlite") and ctx.info_name != "migrate":
        options["migrate"] = False  # only `oncely migrate` changes a schema
        path = _sqlite_file(url)
        if path is not None and not path.exists():  # opening it would create an empty file
            raise SetupError(f"no SQLite database at {str(path)!r}: `oncely migrate` creates one")
    try:
        return oncely.open_store(url, **options)
    except oncely.OncelyError as exc:
        raise _translate(exc) from exc


@contextlib.contextmanager
def _store(ctx: click.Context) -> Iterator[Any]:
    store = _open(ctx)
    try:
        yield store
    except oncely.OncelyError as exc:
        raise _translate(exc) from exc
    finally:
        store.close()


def _require(store: Any, verb: str) -> Any:
    method = getattr(store, verb, None)
    if method is None:
        raise SetupError(f"{type(store).__name__} does not support `{verb}`")
    return method


def _record_dict(record: Record) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["status"] = record.status.value
    result = data.pop("result")
    data["result_bytes"] = None if result is None else len(result)
    if result is not None:
        try:
            outcome = decode_outcome(result)
            data["outcome"] = outcome.kind
            if outcome.kind == "value":
                with contextlib.suppress(ValueError):
                    data["value"] = json.loads(outcome.body)
            elif outcome.kind == "error":
                data["error"] = {"type": outcome.error_type, "args": list(outcome.error_args)}
            else:
                data["reason"] = outcome.reason
        except ValueError:
            data["outcome"] = "foreign"
    return data


_TIMES = ("lease_expires_at_ms", "expires_at_ms", "created_at_ms", "updated_at_ms")


def _when(ms: int, now_ms: int) -> str:
    """*ms* as ISO 8601 UTC with its distance from now (``... (in 4m 10s)``, ``(12s ago)``)."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    text = moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    delta = (ms - now_ms) // 1000
    span = _span(abs(delta))
    return f"{text} ({'in ' + span if delta > 0 else span + ' ago' if delta < 0 else 'now'})"


def _span(seconds: int) -> str:
    """A duration as its two largest units (``1h 2m``, ``4m 10s``, ``12s``)."""
    parts: list[str] = []
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count or (unit == "s" and not parts):
            parts.append(f"{count}{unit}")
    return " ".join(parts[:2])


def _readable(data: dict[str, Any]) -> dict[str, Any]:
    """A record's fields for people: times as ISO 8601 UTC with an age, not epoch ms."""
    now_ms = time.time_ns() // 1_000_000
    return {
        name.removesuffix("_ms") if name in _TIMES else name: (
            _when(int(value), now_ms) if name in _TIMES else value
        )
        for name, value in data.items()
    }


def _emit(ctx: click.Context, data: Any, lines: list[str]) -> None:
    if ctx.obj["json"]:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        for line in lines:
            click.echo(line)


ENV_STORE_URL = "ONCELY_STORE_URL"
"""The environment variable that names the store, for the CLI and the examples alike."""

_STORE_HELP = f"Store URL, e.g. sqlite:///oncely.db or redis://localhost:6379/0 ({ENV_STORE_URL})."
_NAMESPACE_HELP = "The namespace the application opened it with."
_JSON_HELP = "Machine-readable output."

F = TypeVar("F", bound=Callable[..., Any])


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    # An option given after the subcommand overrides the same option given before it.
    if value is not None and value is not False and param.name is not None:
        ctx.find_root().ensure_object(dict)[param.name] = value


def _common_options(command: F) -> F:
    """Accept --store, --namespace and --json after the subcommand too (``oncely stats --json``)."""
    for option in (
        click.option(
            "--json",
            "json",
            is_flag=True,
            default=None,
            expose_value=False,
            callback=_remember,
            help=_JSON_HELP,
        ),
        click.option(
            "--namespace",
            default=None,
            expose_value=False,
            callback=_remember,
            help=_NAMESPACE_HELP,
        ),
        click.option(
            "--store",
            "store_url",
            default=None,
            expose_value=False,
            callback=_remember,
            help=_STORE_HELP,
        ),
    ):
        command = option(command)
    return command


@click.group()
@click.option("--store", "store_url", envvar=ENV_STORE_URL, help=_STORE_HELP)
@click.option("--namespace", default="", help=_NAMESPACE_HELP)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.pass_context
def cli(ctx: click.Context, store_url: str | None, namespace: str, as_json: bool) -> None:
    """Inspect and maintain oncely stores."""
    ctx.obj = {"store_url": store_url, "namespace": namespace, "json": as_json}


@cli.command()
@click.argument("key")
@click.option("--scope", help="The scope the key was used in (a function's module.qualname).")
@_common_options
@click.pass_context
def inspect(ctx: click.Context, key: str, scope: str | None) -> None:
    """Show the record of KEY (the stored key, or KEY within --scope)."""
    stored = scope_key(scope, key) if scope else key
    with _store(ctx) as store:
        record = store.get(stored)
    if record is None:
        raise NotFoundError(f"no live record for {stored!r}")
    data = _record_dict(record)
    _emit(ctx, data, [f"{name:20} {value}" for name, value in _readable(data).items()])


def _all_records(store: Any, page: int = 500) -> Iterator[Record]:
    scan = _require(store, "scan")
    after = ""
    while True:
        records: list[Record] = scan(after=after, limit=page)
        yield from records
        if len(records) < page:
            return
        after = records[-1].key


@cli.command()
@click.option("--stuck", is_flag=True, help="Only leases that expired without settling.")
@click.option("--limit", default=100, show_default=True, help="At most this many.")
@_common_options
@click.pass_context
def leases(ctx: click.Context, stuck: bool, limit: int) -> None:
    """List in-progress records: held leases, or with --stuck abandoned ones."""
    rows: list[dict[str, Any]] = []
    with _store(ctx) as store:
        for record in _all_records(store):
            if record.status is Status.IN_PROGRESS:
                row = _record_dict(record)
                if not stuck or _lease_expired(row):
                    rows.append(row)
                    if len(rows) >= limit:
                        break
    _emit(
        ctx,
        rows,
        [
            f"{row['key']}  token={row['token']} attempt={row['attempt']} "
            f"lease_expires_at={_readable(row)['lease_expires_at']}"
            for row in rows
        ]
        or ["no leases"],
    )


def _lease_expired(row: dict[str, Any]) -> bool:
    # The store's clock judges leases; the host clock is close enough for a listing.
    return int(row["lease_expires_at_ms"]) <= time.time_ns() // 1_000_000


@cli.command()
@click.argument("key")
@click.option("--token", type=int, required=True, help="The fencing token of the lease to release.")
@click.option("--scope", help="The scope the key was used in (a function's module.qualname).")
@_common_options
@click.pass_context
def release(ctx: click.Context, key: str, token: int, scope: str | None) -> None:
    """Release the lease TOKEN of KEY, so the next claim runs the operation again.

    Only for a lease whose worker is known to be gone: a live worker would then run beside
    the next claimer (its own complete fails with a lost lease).
    """
    stored = scope_key(scope, key) if scope else key
    with _store(ctx) as store:
        answer = store.release(stored, token)
    if answer is not None:
        raise NotFoundError(f"{stored!r} holds no lease with token {token}")
    _emit(
        ctx, {"released": True, "key": stored, "token": token}, [f"released {stored} token={token}"]
    )


@cli.command()
@click.argument("key")
@click.option("--scope", help="The scope the key was used in (a function's module.qualname).")
@click.option("--force", is_flag=True, help="Forget an in-progress record too, ending its lease.")
@_common_options
@click.pass_context
def forget(ctx: click.Context, key: str, scope: str | None, force: bool) -> None:
    """Forget the finished record of KEY, so the next request with it runs again.

    The record becomes a released tombstone that keeps its fencing token until it expires.
    An in-progress record is refused (exit 1) unless --force: only for a worker known to be
    gone, since a live one would then run beside the next claimer.
    """
    stored = scope_key(scope, key) if scope else key
    try:
        with _store(ctx) as store:
            status = _require(store, "forget")(stored, force=force)
    except FailedError as exc:
        if isinstance(exc.__cause__, oncely.ConflictError):
            raise NotFoundError(str(exc.__cause__)) from exc.__cause__
        raise
    if status is None:
        raise NotFoundError(f"no live record for {stored!r}")
    _emit(
        ctx,
        {"forgotten": True, "key": stored, "status": status.value},
        [f"forgot {stored} ({status.value})"],
    )


@cli.command()
@_common_options
@click.pass_context
def stats(ctx: click.Context) -> None:
    """Count live records by status."""
    counts = {status.value: 0 for status in Status}
    with _store(ctx) as store:
        for record in _all_records(store):
            counts[record.status.value] += 1
    _emit(ctx, counts, [f"{name:12} {count}" for name, count in counts.items()])


@cli.command()
@click.option("--batch", default=1000, show_default=True, help="Records per transaction.")
@_common_options
@click.pass_context
def purge(ctx: click.Context, batch: int) -> None:
    """Delete expired records."""
    with _store(ctx) as store:
        deleted = _require(store, "purge")(batch=batch)
    _emit(ctx, {"deleted": deleted}, [f"deleted {deleted} expired records"])


@cli.command()
@click.option("--sql", is_flag=True, help="Print the DDL instead of applying it.")
@_common_options
@click.pass_context
def migrate(ctx: click.Context, sql: bool) -> None:
    """Create or upgrade the store's schema (idempotent).

    With --sql, print the script for a migration tool (Alembic, Django) and change nothing.
    """
    if sql:
        click.echo(_schema_sql(ctx), nl=False)
        return
    url = ctx.obj.get("store_url") or ""
    path = _sqlite_file(url.removeprefix("tiered+"))
    before = None if path is None else _sqlite_version(path)  # read before opening migrates
    with _store(ctx) as store:
        if path is None:
            before = _schema_version(store)
        _require(store, "migrate")()
        after = _schema_version(store)
        if getattr(getattr(store, "inner", store), "backend", None) in ("postgres", "sqlite"):
            from oncely.observe.activity import migrate_activity

            migrate_activity(store)  # the dashboard's activity tables
    if before == after:
        line = f"the oncely schema is already up to date (version {after})"
    elif before is None:
        line = f"created the oncely schema (version {after})"
    else:
        line = f"upgraded the oncely schema from version {before} to {after}"
    _emit(ctx, {"migrated": True, "before": before, "after": after}, [line])


def _sqlite_file(url: str) -> Path | None:
    """The database file a ``sqlite:///`` URL names (``None``: not one, or in memory)."""
    if not url.startswith("sqlite://"):
        return None
    name = url.partition("://")[2][1:].partition("?")[0]
    return None if name in ("", ":memory:") else Path(name)


def _sqlite_version(path: Path) -> int | None:
    """The oncely schema version in the SQLite file at *path*, read without creating it."""
    if not path.exists():
        return None
    try:
        with contextlib.closing(
            sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        ) as db:
            row = db.execute("SELECT version FROM oncely_schema WHERE id = 1").fetchone()
    except sqlite3.Error:  # no such table: no schema
        return None
    return None if row is None else int(row[0])


def _schema_version(opened: Any) -> int | None:
    """The oncely schema version *opened* holds (``None``: none), an older one included."""
    store = getattr(opened, "inner", opened)  # a tiered store's schema is its inner one's
    try:
        version: int | None = store.check().schema_version
    except oncely.SchemaMissingError:
        if store.backend != "postgres":
            return None
        from oncely._core.flow import drive
        from oncely.stores.postgres import _sql

        try:  # `check` refuses an older schema: read its version as it is
            version = drive(_sql.schema_version(store._queries), store._execute)
        except oncely.SchemaMissingError:  # no version table
            return None
    return version


def _schema_sql(ctx: click.Context) -> str:
    url = (ctx.obj.get("store_url") or "").removeprefix("tiered+")
    if url.startswith("sqlite"):
        # The same script for every SQLite database: nothing to open (opening would migrate).
        from oncely.stores.sqlite import SQLiteStore
        from oncely.stores.sqlite._activity import SQLiteActivity

        return SQLiteStore.schema_sql() + _ACTIVITY_HEADER + SQLiteActivity.schema_sql()
    with _store(ctx) as opened:
        store = getattr(opened, "inner", opened)  # a tiered store's schema is its inner one's
        if getattr(store, "schema_sql", None) is None:
            raise SetupError(f"{type(store).__name__} has no schema to print")
        script: str = store.schema_sql()
        from oncely.observe.activity import activity_schema_sql

        activity = activity_schema_sql(store)
    return script + (_ACTIVITY_HEADER + activity if activity else "")


_ACTIVITY_HEADER = "\n-- the activity the dashboard reads (oncely.observe.record_activity)\n"


@cli.command()
@_common_options
@click.pass_context
def check(ctx: click.Context) -> None:
    """Check that the store answers and its schema is migrated (a readiness probe).

    Exits 0 when ready, 2 when the schema needs `oncely migrate` or the settings are wrong
    (a role, password or database the server refuses), 3 when the store is unreachable.
    """
    with _store(ctx) as store:
        health = _require(store, "check")()
    data = dataclasses.asdict(health)
    version = "no schema" if health.schema_version is None else f"schema {health.schema_version}"
    _emit(ctx, data, [f"ready: {health.backend}, {version}, {health.latency_ms:.1f} ms"])


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,  # --help goes to the demo, which lists its own options
)
@click.pass_context
def demo(ctx: click.Context) -> None:
    """Run the retry-storm demo (`oncely demo --help` lists its options)."""
    from oncely._demos.storm import main as demo_main

    ctx.exit(demo_main(list(ctx.args), prog="oncely demo"))


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, help="Port to listen on (0: any).")
@click.option(
    "--token",
    envvar="ONCELY_DASHBOARD_TOKEN",
    help="Require this token (16+ characters): Bearer header, or open /?token=... once.",
)
@_common_options
@click.pass_context
def dashboard(ctx: click.Context, host: str, port: int, token: str | None) -> None:
    """Serve a read-only dashboard of the store (and Prometheus text at /metrics)."""
    from oncely.dashboard import serve

    with _store(ctx) as store:
        try:
            server = serve(store, host=host, port=port, token=token or None)
        except OSError as exc:
            raise SetupError(f"cannot listen on {host}:{port}: {exc}") from exc
        except oncely.ConfigurationError as exc:
            raise SetupError(str(exc)) from exc
        if host not in ("127.0.0.1", "::1", "localhost") and not token:
            click.echo(f"dashboard: listening on {host} without a token", err=True)
        click.echo(f"dashboard: http://{host}:{server.server_port}/", err=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


@cli.command()
@click.option(
    "--to", "to", envvar="ONCELY_RELAY_TO", help="Broker URL: amqp://, kafka://, nats://, redis://."
)
@click.option(
    "--publisher",
    "factory",
    help="module:callable returning a Publisher (called with the --to URL if given).",
)
@click.option("--batch-size", default=100, show_default=True, help="Events per batch.")
@click.option("--poll-interval", default=1.0, show_default=True, help="Seconds between polls.")
@click.option(
    "--max-attempts", default=10, show_default=True, help="Failures before dead-lettering."
)
@click.option(
    "--retention", default=86400.0, show_default=True, help="Seconds published events are kept."
)
@click.option("--no-listen", is_flag=True, help="Poll only (no LISTEN/NOTIFY on PostgreSQL).")
@_common_options
@click.pass_context
def relay(
    ctx: click.Context,
    to: str | None,
    factory: str | None,
    batch_size: int,
    poll_interval: float,
    max_attempts: int,
    retention: float,
    no_listen: bool,
) -> None:
    """Publish the outbox's committed events to a broker until SIGTERM or SIGINT."""
    from oncely.outbox import Relay, publisher_from_url
    from oncely.outbox._registry import load_factory

    if not to and not factory:
        raise SetupError("no broker: pass --to URL (or --publisher module:callable)")
    try:
        if factory:
            make = load_factory(factory)
            publisher = make(to) if to else make()
        else:
            assert to is not None
            publisher = publisher_from_url(to)
    except oncely.OncelyError as exc:
        raise _translate(exc) from exc
    with _store(ctx) as store:
        runner = Relay(
            store,
            publisher,
            batch_size=batch_size,
            poll_interval=poll_interval,
            max_attempts=max_attempts,
            retention=retention,
            listen=not no_listen,
        )
        click.echo(f"relay: publishing the outbox of {store!r}", err=True)
        runner.run_forever()
        click.echo("relay: stopped", err=True)


@cli.group()
def outbox() -> None:
    """Inspect the transactional outbox."""


@outbox.command(name="stats")
@_common_options
@click.pass_context
def outbox_stats(ctx: click.Context) -> None:
    """Count pending, dead-lettered and published outbox events."""
    from oncely.outbox._relay import backend_stats

    with _store(ctx) as store:
        counts = backend_stats(store)
    _emit(ctx, counts, [f"{name:15} {value}" for name, value in counts.items()])


@outbox.command(name="dead")
@click.option("--limit", default=100, show_default=True, help="At most this many.")
@_common_options
@click.pass_context
def outbox_dead(ctx: click.Context, limit: int) -> None:
    """List dead-lettered outbox events, oldest first."""
    from oncely.outbox import _admin

    with _store(ctx) as store:
        events = _admin.dead_letters(store, limit)
    _emit(
        ctx,
        [dataclasses.asdict(event) for event in events],
        [
            f"{event.id}  {event.message_id}  to={event.destination} key={event.ordering_key} "
            f"attempts={event.attempts} dead_at={event.dead_at}  {event.last_error}"
            for event in events
        ]
        or ["no dead letters"],
    )


def _outbox_verb(ctx: click.Context, verb: str, event_id: int) -> None:
    from oncely.outbox import _admin

    change = {
        "retry": _admin.retry,
        "dead-letter": _admin.dead_letter,
        "resend": _admin.resend,
    }[verb]
    with _store(ctx) as store:
        try:
            event = change(store, event_id)
        except _admin.NoSuchEventError as exc:
            raise NotFoundError(str(exc)) from exc
        except _admin.StateError as exc:
            raise FailedError(str(exc)) from exc
    data = {**dataclasses.asdict(event), "state": event.state}
    moved = "" if event.id == event_id else f" as event {event.id}"
    _emit(ctx, data, [f"{verb}: outbox event {event_id} is {event.state}{moved}"])


@outbox.command(name="retry")
@click.argument("event_id", metavar="ID", type=int)
@_common_options
@click.pass_context
def outbox_retry(ctx: click.Context, event_id: int) -> None:
    """Publish event ID again soon: a dead letter is queued again after its key's pending
    events, a pending event waiting out its backoff is due now."""
    _outbox_verb(ctx, "retry", event_id)


@outbox.command(name="dead-letter")
@click.argument("event_id", metavar="ID", type=int)
@_common_options
@click.pass_context
def outbox_dead_letter(ctx: click.Context, event_id: int) -> None:
    """Set pending event ID aside as a dead letter: the later events of its key and
    destination go on without it."""
    _outbox_verb(ctx, "dead-letter", event_id)


@outbox.command(name="resend")
@click.argument("event_id", metavar="ID", type=int)
@_common_options
@click.pass_context
def outbox_resend(ctx: click.Context, event_id: int) -> None:
    """Publish published (or dead) event ID again, with its message id, after its key's
    pending events (an oncely consumer that had it deduplicates it)."""
    _outbox_verb(ctx, "resend", event_id)
