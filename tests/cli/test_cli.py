"""The oncely command line, driven through click's CliRunner against a SQLite file."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

import oncely
from oncely.cli._app import cli
from tests.conftest import service_url


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/oncely.db"
    store = oncely.open_store(url)

    @oncely.idempotent(store=store, key="k", scope="billing.charge")
    def charge(k: str) -> dict[str, int]:
        return {"cents": 500}

    charge("p-1")
    charge("p-2")
    store.claim("stuck", "fp", lease=timedelta(milliseconds=1), ttl=timedelta(hours=1))
    store.claim("held", "fp", lease=timedelta(hours=1), ttl=timedelta(hours=1))
    answer = store.claim("old", "fp", lease=timedelta(hours=1), ttl=timedelta(hours=1))
    assert isinstance(answer, oncely.Acquired)
    store.complete("old", answer.token, b"x", ttl=timedelta(milliseconds=1))
    store.close()
    return url


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_inspect_shows_the_decoded_outcome(url: str) -> None:
    """inspect KEY --scope S prints the record and its stored value."""
    code, out = run("--store", url, "--json", "inspect", "p-1", "--scope", "billing.charge")
    assert code == 0
    record = json.loads(out)
    assert (record["status"], record["token"], record["value"]) == ("completed", 1, {"cents": 500})
    code, out = run("--store", url, "inspect", "p-1", "--scope", "billing.charge")
    assert code == 0
    assert "completed" in out


def test_inspect_missing_key_exits_1(url: str) -> None:
    """A key with no live record exits with status 1."""
    code, out = run("--store", url, "inspect", "nope")
    assert code == 1
    assert "no live record" in out


def test_leases_and_stuck_leases(url: str) -> None:
    """leases lists in-progress records; --stuck only those whose lease has expired."""
    code, out = run("--store", url, "--json", "leases")
    assert code == 0
    assert {row["key"] for row in json.loads(out)} == {"stuck", "held"}
    code, out = run("--store", url, "--json", "leases", "--stuck")
    assert [row["key"] for row in json.loads(out)] == ["stuck"]


def test_stats_and_purge(url: str) -> None:
    """stats counts live records by status; purge deletes the expired one."""
    code, out = run("--store", url, "--json", "stats")
    assert code == 0
    assert json.loads(out) == {"completed": 2, "failed": 0, "in_progress": 2, "released": 0}
    code, out = run("--store", url, "--json", "purge")
    assert (code, json.loads(out)) == (0, {"deleted": 1})


def test_migrate_then_use(tmp_path: Path) -> None:
    """Other commands refuse a store without schema; migrate creates it."""
    url = f"sqlite:///{tmp_path}/new.db"
    code, out = run("--store", url, "stats")
    assert code == 2
    assert "migrate" in out
    assert run("--store", url, "migrate")[0] == 0
    assert run("--store", url, "migrate")[0] == 0
    assert run("--store", url, "stats")[0] == 0


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["stats"], 2),
        (["--store", "dynamo://x", "stats"], 2),
        (["--store", "sqlite:///"], 2),
    ],
)
def test_setup_errors_exit_2(args: list[str], code: int) -> None:
    """No store, an unknown scheme or a bad URL exit with status 2 and a message."""
    exit_code, out = run(*args)
    assert exit_code == code
    assert out.strip()


def test_unreachable_store_exits_3() -> None:
    """A store whose server refuses the connection is 'unavailable', exit status 3."""
    code, out = run("--store", "redis://127.0.0.1:1/0", "check")
    assert code == 3
    assert "unavailable" in out


def test_sqlite_file_in_a_missing_folder_exits_2(tmp_path: Path) -> None:
    """A missing folder is a setting to fix (status 2, the folder named), not an outage."""
    code, out = run("--store", f"sqlite:///{tmp_path}/missing-dir/x/y.db", "migrate")
    assert code == 2
    assert "missing-dir" in out
    assert "does not exist" in out


def test_entry_point_without_click() -> None:
    """Without the cli extra, the entry point says which extra to install."""
    code = "import sys; sys.modules['click'] = None; from oncely.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "pip install 'oncely[cli]'" in result.stderr


def test_module_entry_point_runs(url: str) -> None:
    """python -m oncely.cli works like the console script."""
    result = subprocess.run(
        [sys.executable, "-m", "oncely.cli", "--store", url, "--json", "stats"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout)["completed"] == 2


def test_options_after_the_subcommand(url: str) -> None:
    """--store, --namespace and --json work after the subcommand too, as the README shows."""
    code, out = run("stats", "--store", url, "--json")
    assert code == 0
    assert json.loads(out)["completed"] == 2
    code, out = run("--store", url, "inspect", "p-1", "--scope", "billing.charge", "--json")
    assert json.loads(out)["token"] == 1
    code, out = run("--store", "sqlite:///nowhere.db", "stats", "--store", url, "--json")
    assert (code, json.loads(out)["completed"]) == (0, 2)  # the later --store wins


def test_people_read_iso_times_with_an_age(url: str) -> None:
    """Plain output shows ISO 8601 UTC times with their age; raw milliseconds only in --json."""
    code, out = run("--store", url, "inspect", "p-1", "--scope", "billing.charge")
    assert code == 0
    assert "_ms" not in out
    created = next(line for line in out.splitlines() if line.startswith("created_at "))
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \((\d+s ago|now)\)", created)
    expires = next(line for line in out.splitlines() if line.startswith("expires_at "))
    assert re.search(r"Z \(in (\d+[dhm] )*\d+[dhms]\)", expires)
    code, out = run("--store", url, "leases")
    assert "lease_expires_at=" in out
    assert "Z (" in out
    code, out = run("--store", url, "--json", "inspect", "p-1", "--scope", "billing.charge")
    assert isinstance(json.loads(out)["created_at_ms"], int)


def test_release_a_stuck_lease(url: str) -> None:
    """release KEY --token N gives a lease back; a wrong token is refused with exit 1."""
    code, out = run("--store", url, "release", "held", "--token", "7")
    assert code == 1
    assert "no lease with token 7" in out
    code, out = run("--store", url, "--json", "release", "held", "--token", "1")
    assert (code, json.loads(out)["released"]) == (0, True)
    code, out = run("--store", url, "--json", "stats")
    assert json.loads(out)["released"] == 1


def test_demo_help_lists_the_demo_options() -> None:
    """oncely demo --help shows the demo's own options, not an empty click page."""
    code, out = run("demo", "--help")
    assert code == 0
    assert "--payments" in out
    assert out.startswith("usage: oncely demo")


def test_check_is_a_readiness_probe(url: str, tmp_path: Path) -> None:
    """check exits 0 with what it found; an unmigrated database exits 2, naming migrate."""
    code, out = run("--store", url, "--json", "check")
    assert code == 0
    health = json.loads(out)
    assert (health["backend"], health["schema_version"]) == ("sqlite", 2)
    assert health["latency_ms"] >= 0
    code, out = run("--store", url, "check")
    assert (code, out.startswith("ready: sqlite, schema 2, ")) == (0, True)
    code, out = run("--store", f"sqlite:///{tmp_path}/fresh.db", "check")
    assert code == 2
    assert "oncely migrate" in out
    code, out = run("--store", "memory://", "check")
    assert (code, out.startswith("ready: memory, no schema")) == (0, True)


@pytest.mark.postgres
@pytest.mark.redis
def test_check_exit_codes_against_servers() -> None:
    """A role the PostgreSQL server refuses exits 2 with its reason; no server there exits 3."""
    postgres = service_url("ONCELY_TEST_POSTGRES_URL")
    refused = re.sub(r"//[^@/]*@", "//oncely_no_such_role_cli@", postgres)
    if "@" not in postgres:
        refused = postgres.replace("//", "//oncely_no_such_role_cli@", 1)
    code, out = run("--store", refused, "check")
    assert code == 2
    assert 'role "oncely_no_such_role_cli" does not exist' in out
    code, out = run("--store", "redis://127.0.0.1:27599/0", "check")  # nothing listens there
    assert code == 3
    assert "unavailable" in out


def test_migrate_sql_prints_the_sqlite_ddl_and_changes_nothing(tmp_path: Path) -> None:
    """migrate --sql prints SQLite's schema script; no database file is created."""
    path = tmp_path / "never.db"
    for prefix in ("", "tiered+"):
        code, out = run("--store", f"{prefix}sqlite:///{path}", "migrate", "--sql")
        assert code == 0
        assert "CREATE TABLE IF NOT EXISTS oncely_records" in out
        assert "CREATE TABLE IF NOT EXISTS oncely_activity (" in out  # the dashboard's
        assert not path.exists()
    code, out = run("--store", "memory://", "migrate", "--sql")
    assert code == 2
    assert "no schema" in out


@pytest.mark.postgres
def test_migrate_sql_prints_the_postgres_ddl_for_its_schema() -> None:
    """migrate --sql renders the script for the URL's schema without applying it; applied in
    one transaction by someone else (a migration tool), it makes a store ready."""
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_cli_sql_{uuid.uuid4().hex[:10]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    with psycopg.connect(base, autocommit=True) as admin:
        try:
            code, out = run("--store", url, "migrate", "--sql")
            assert code == 0
            assert f'CREATE SCHEMA IF NOT EXISTS "{schema}"' in out
            exists = admin.execute(
                "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)
            )
            assert exists.fetchone() == (0,)
            assert run("--store", url, "check")[0] == 2
            with admin.transaction():
                admin.execute(out.encode())
            code, out = run("--store", url, "--json", "check")
            assert (code, json.loads(out)["schema_version"]) == (0, 3)
            tables = admin.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = %s"
                " AND tablename IN ('oncely_activity', 'oncely_activity_recent')",
                (schema,),
            )
            assert tables.fetchone() == (2,)
        finally:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_forget_a_finished_record_and_refuse_a_held_one(url: str) -> None:
    """forget KEY --scope S makes the next call run again; an in-progress record exits 1
    unless --force; a key with no record exits 1."""
    code, out = run("--store", url, "--json", "forget", "p-1", "--scope", "billing.charge")
    assert (code, json.loads(out)["status"]) == (0, "completed")
    code, out = run("--store", url, "--json", "inspect", "p-1", "--scope", "billing.charge")
    assert json.loads(out)["status"] == "released"
    code, out = run("--store", url, "forget", "held")
    assert code == 1
    assert "--force" in out
    code, out = run("--store", url, "--json", "inspect", "held")
    assert json.loads(out)["status"] == "in_progress"
    code, out = run("--store", url, "forget", "held", "--force")
    assert (code, out.strip()) == (0, "forgot held (in_progress)")
    code, out = run("--store", url, "forget", "nope")
    assert code == 1
    assert "no live record" in out
    code, out = run("--store", url, "--json", "stats")
    assert json.loads(out) == {"completed": 1, "failed": 0, "in_progress": 1, "released": 2}


def test_stats_counts_the_same_through_a_tiered_store(url: str) -> None:
    """stats (and leases) page through a tiered store's inner store: the same counts."""
    code, out = run("--store", url.replace("sqlite", "tiered+sqlite", 1), "--json", "stats")
    assert code == 0
    assert json.loads(out) == {"completed": 2, "failed": 0, "in_progress": 2, "released": 0}


@pytest.mark.parametrize(
    "verb",
    [["stats"], ["leases"], ["inspect", "k"], ["check"], ["purge"], ["forget", "k"]],
)
def test_a_verb_on_a_missing_sqlite_file_says_so_and_creates_nothing(
    tmp_path: Path, verb: list[str]
) -> None:
    path = tmp_path / "x.db"
    code, out = run("--store", f"sqlite:///{path}", *verb)
    assert code == 2
    assert f"no SQLite database at {str(path)!r}" in out
    assert "oncely migrate" in out
    assert list(tmp_path.iterdir()) == []  # not even the file


def test_migrate_says_what_it_did_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    code, out = run("--store", url, "migrate")
    assert (code, out.strip()) == (0, "created the oncely schema (version 2)")
    code, out = run("--store", url, "migrate")
    assert (code, out.strip()) == (0, "the oncely schema is already up to date (version 2)")
    code, out = run("--store", url, "--json", "migrate")
    assert json.loads(out) == {"migrated": True, "before": 2, "after": 2}
    with contextlib.closing(sqlite3.connect(tmp_path / "x.db")) as db:
        tables = db.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'"
            " AND name IN ('oncely_activity', 'oncely_activity_recent')"
        )
        assert tables.fetchone() == (2,)  # the dashboard's activity, created by migrate too


@pytest.mark.postgres
def test_migrate_says_what_it_did_on_postgres() -> None:
    base = service_url("ONCELY_TEST_POSTGRES_URL")
    schema = f"oncely_cli_{uuid.uuid4().hex[:8]}"
    url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
    try:
        code, out = run("--store", url, "--json", "migrate")
        assert (code, json.loads(out)["before"]) == (0, None)
        after = json.loads(out)["after"]
        with psycopg.connect(base, autocommit=True) as connection:
            tables = connection.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = %s"
                " AND tablename IN ('oncely_activity', 'oncely_activity_recent')",
                (schema,),
            )
            assert tables.fetchone() == (2,)
        code, out = run("--store", url, "migrate")
        assert (code, out.strip()) == (
            0,
            f"the oncely schema is already up to date (version {after})",
        )
        with psycopg.connect(base, autocommit=True) as connection:  # an older schema
            connection.execute(f'UPDATE "{schema}".oncely_schema SET version = version - 1')
        code, out = run("--store", url, "migrate")
        assert (code, out.strip()) == (
            0,
            f"upgraded the oncely schema from version {after - 1} to {after}",
        )
    finally:
        with psycopg.connect(base, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
