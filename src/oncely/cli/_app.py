"""The click application behind ``oncely``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

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
        raise SetupError("no store: pass --store URL or set ONCELY_STORE_URL")
    options: dict[str, Any] = {"namespace": ctx.obj["namespace"]}
    if url.startswith("sqlite") and ctx.info_name != "migrate":
        options["migrate"] = False  # only `oncely migrate` changes a schema
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


def _emit(ctx: click.Context, data: Any, lines: list[str]) -> None:
    if ctx.obj["json"]:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        for line in lines:
            click.echo(line)


@click.group()
@click.option(
    "--store",
    "store_url",
    envvar="ONCELY_STORE_URL",
    help="Store URL, e.g. sqlite:///oncely.db or redis://localhost:6379/0 (ONCELY_STORE_URL).",
)
@click.option("--namespace", default="", help="The namespace the application opened it with.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def cli(ctx: click.Context, store_url: str | None, namespace: str, as_json: bool) -> None:
    """Inspect and maintain oncely stores."""
    ctx.obj = {"store_url": store_url, "namespace": namespace, "json": as_json}


@cli.command()
@click.argument("key")
@click.option("--scope", help="The scope the key was used in (a function's module.qualname).")
@click.pass_context
def inspect(ctx: click.Context, key: str, scope: str | None) -> None:
    """Show the record of KEY (the stored key, or KEY within --scope)."""
    stored = scope_key(scope, key) if scope else key
    with _store(ctx) as store:
        record = store.get(stored)
    if record is None:
        raise NotFoundError(f"no live record for {stored!r}")
    data = _record_dict(record)
    _emit(ctx, data, [f"{name:20} {value}" for name, value in data.items()])


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
            f"lease_expires_at_ms={row['lease_expires_at_ms']}"
            for row in rows
        ]
        or ["no leases"],
    )


def _lease_expired(row: dict[str, Any]) -> bool:
    # The store's clock judges leases; the host clock is close enough for a listing.
    return int(row["lease_expires_at_ms"]) <= time.time_ns() // 1_000_000


@cli.command()
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
@click.pass_context
def purge(ctx: click.Context, batch: int) -> None:
    """Delete expired records."""
    with _store(ctx) as store:
        deleted = _require(store, "purge")(batch=batch)
    _emit(ctx, {"deleted": deleted}, [f"deleted {deleted} expired records"])


@cli.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the store's schema (idempotent)."""
    with _store(ctx) as store:
        _require(store, "migrate")()
    _emit(ctx, {"migrated": True}, ["schema is up to date"])


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def demo(ctx: click.Context) -> None:
    """Run the retry-storm demo (options as for python -m oncely.demo)."""
    from oncely._demo import main as demo_main

    ctx.exit(demo_main(list(ctx.args)))
