"""Testing code that uses oncely: store overrides, the off switch and the pytest fixture."""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import oncely
from oncely.testing import disabled, override_store


def make_charge(store: oncely.Store) -> tuple[list[str], object]:
    calls: list[str] = []

    @oncely.idempotent(store=store, key="order_id", scope="billing.charge")
    def charge(order_id: str) -> str:
        calls.append(order_id)
        return f"charged {order_id}"

    return calls, charge


def test_override_every_decorated_function() -> None:
    real, test = oncely.open_store("memory://"), oncely.open_store("memory://")
    calls, charge = make_charge(real)
    with override_store(test) as store:
        assert charge("o-1") == charge("o-1") == "charged o-1"  # type: ignore[operator]
        assert store.get("billing.charge|o-1") is not None
    assert real.get("billing.charge|o-1") is None
    charge("o-1")  # type: ignore[operator]  # back on the real store: runs again
    assert calls == ["o-1", "o-1"]


def test_override_one_function() -> None:
    real, test = oncely.open_store("memory://"), oncely.open_store("memory://")
    _, charge = make_charge(real)
    _, other = make_charge(real)
    with override_store(test, charge):  # type: ignore[arg-type]
        charge("o-1")  # type: ignore[operator]
        other("o-2")  # type: ignore[operator]
    assert test.get("billing.charge|o-1") is not None
    assert real.get("billing.charge|o-2") is not None
    with pytest.raises(oncely.ConfigurationError), override_store(test, print):
        pass


def test_override_async_functions() -> None:
    test = oncely.open_store("memory://")

    @oncely.idempotent(store=oncely.open_store("memory://"), key="k", scope="s")
    async def ship(k: str) -> str:
        return k

    with override_store(test):
        assert asyncio.run(ship("a")) == "a"
    assert test.get("s|a") is not None


def test_disabled_runs_unprotected_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    calls, charge = make_charge(oncely.open_store("memory://"))
    with disabled(), caplog.at_level(logging.WARNING, logger="oncely"):
        charge("o-1")  # type: ignore[operator]
        charge("o-1")  # type: ignore[operator]
    assert calls == ["o-1", "o-1"]
    warnings = [r.getMessage() for r in caplog.records if "UNPROTECTED" in r.getMessage()]
    assert len(warnings) == 2
    assert "billing.charge" in warnings[0]
    charge("o-1")  # type: ignore[operator]
    charge("o-1")  # type: ignore[operator]
    assert calls == ["o-1", "o-1", "o-1"]  # protected again after the block


def test_the_environment_variable_turns_protection_off() -> None:
    code = textwrap.dedent(
        """
        import oncely
        calls = []

        @oncely.idempotent(store="memory://", key="k")
        def f(k):
            calls.append(k)

        f("a"); f("a")
        print(len(calls))
        """
    )
    env = {**os.environ, "ONCELY_DISABLED": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "2"
    assert "UNPROTECTED" in result.stderr


def test_the_pytest_fixture_gives_each_test_a_fresh_store(tmp_path: Path) -> None:
    (tmp_path / "test_app.py").write_text(
        textwrap.dedent(
            """
            import oncely

            calls = []

            @oncely.idempotent(store="sqlite:///never-used.db", key="k")
            def charge(k):
                calls.append(k)

            def test_one(oncely_store):
                charge("a"); charge("a")
                assert calls == ["a"]

            def test_two(oncely_store):
                charge("a")  # a fresh store: runs again
                assert calls == ["a", "a"]
                assert oncely_store.get("test_app.charge|a") is not None
            """
        )
    )
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["oncely.pytest_plugin"]\n')
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_app.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_store_conformance_without_hypothesis_names_the_extra(tmp_path: Path) -> None:
    """With hypothesis missing, StoreConformance fails with MissingDependencyError naming
    oncely[testing], the extra that installs what the suite needs."""
    (tmp_path / "hypothesis.py").write_text("raise ImportError('no hypothesis here')\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "try:\n    from oncely.testing import StoreConformance\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "MissingDependencyError" in done.stdout
    assert "oncely[testing]" in done.stdout


def test_the_testing_extra_installs_what_store_conformance_imports() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras["testing"]}
    assert {"pytest", "hypothesis"} <= names
    # Every module outside the standard library that the suite imports is one of them.
    package = Path(oncely.__file__).parent / "testing"
    imported: set[str] = set()
    for module in package.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.partition(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"oncely", "__future__"}
    assert third_party <= names, third_party - names


def test_the_guides_store_of_your_own_passes_the_public_conformance_suite(tmp_path: Path) -> None:
    """The testing guide's example, run by pytest as a reader would run it: the whole public
    suite collects from ``oncely.testing.conformance``, and its claim and settle rows pass
    against the example's store (the memory store runs all of it in tests/conformance)."""
    guide = (Path(__file__).resolve().parents[1] / "docs/guides/testing.md").read_text()
    section = guide[guide.index("## Testing your own store") :]
    match = re.search(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert match is not None
    (tmp_path / "test_my_store.py").write_text(match.group(1))
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_store.py"]
    collected = subprocess.run(
        [*command, "--collect-only"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert collected.returncode == 0, collected.stdout + collected.stderr
    count = re.search(r"(\d+) tests? collected", collected.stdout)
    assert count is not None, collected.stdout
    assert int(count.group(1)) > 100, collected.stdout
    done = subprocess.run(
        [*command, "-k", "test_claim_ or test_settle_"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed is not None, done.stdout
    assert int(passed.group(1)) > 30, done.stdout
    assert "skipped" not in done.stdout, done.stdout
