"""Every Python example in the README and the docs runs as written, and runs again."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import service_url

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    ROOT / "README.md",
    *sorted(path for path in (ROOT / "docs").rglob("*.md") if "_build" not in path.parts),
]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SKIP_MARK = "<!-- not run -->"
DATABASE_MARK = "DATABASE_URL"
"""An example that reads this environment variable gets a PostgreSQL database of its own."""
DJANGO_MARK = "import django"
"""An example that configures Django runs in a process of its own (settings are per process)."""


def _examples() -> list[object]:
    examples = []
    for document in DOCUMENTS:
        text = document.read_text()
        for number, match in enumerate(BLOCK.finditer(text), start=1):
            preceding = text[: match.start()].rstrip().splitlines()[-1:]
            if preceding == [SKIP_MARK]:
                continue
            name = f"{document.relative_to(ROOT)}#{number}"
            marks = [pytest.mark.postgres] if DATABASE_MARK in match.group(1) else []
            examples.append(pytest.param(match.group(1), id=name, marks=marks))
    return examples


@contextlib.contextmanager
def _database() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards: the examples create their tables as
    an application would, and their names (orders) would collide in a shared one."""
    import psycopg

    base = service_url("ONCELY_TEST_POSTGRES_URL")
    name = f"oncely_docs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    try:
        yield urlunsplit(urlsplit(base)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize("code", _examples())
def test_example_runs_twice(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example runs as a fresh module, in a fresh working directory, without raising; then
    it runs again, as a reader who runs it a second time would: a new module, the same working
    directory (its files are still there), the same database and servers (their rows and keys
    are too). With a PostgreSQL database of its own if it reads DATABASE_URL; in a process of
    its own if it configures Django."""
    with contextlib.ExitStack() as stack:
        if DATABASE_MARK in code:
            monkeypatch.setenv(DATABASE_MARK, stack.enter_context(_database()))
        run = _run_in_a_process if DJANGO_MARK in code else _run_here
        for attempt in ("first", "second"):
            try:
                run(code, tmp_path, monkeypatch)
            except Exception as error:
                raise AssertionError(f"the example failed on its {attempt} run") from error


def _run_in_a_process(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "error", "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


def _run_here(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's temporary files
    module = types.ModuleType("__docs__")  # a real module, as a reader's code would be
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    try:
        exec(compile(code, "<docs>", "exec"), namespace)
    finally:
        for value in namespace.values():
            close = getattr(value, "close", None)
            if callable(close) and type(value).__name__.endswith("Store"):
                close()


RECIPES = sorted((ROOT / "docs" / "recipes").glob("*.md"))


def test_every_recipe_has_code_that_runs_and_is_linked_from_a_guide() -> None:
    """Each recipe holds a Python block the examples test runs, and a guide links to it."""
    assert len(RECIPES) >= 10
    guides = "".join(path.read_text() for path in (ROOT / "docs" / "guides").glob("*.md"))
    for recipe in RECIPES:
        text = recipe.read_text()
        run = [
            match
            for match in BLOCK.finditer(text)
            if text[: match.start()].rstrip().splitlines()[-1:] != [SKIP_MARK]
        ]
        assert run, recipe.name
        assert f"(../recipes/{recipe.name}" in guides, recipe.name


def test_api_reference_is_current() -> None:
    """docs/reference.md matches the docstrings (regenerate: python scripts/gen_reference.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts/gen_reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs/reference.md").read_text() == module.render()


def test_benchmark_figures_are_current() -> None:
    """The docs' figures are the results files' (regenerate: python scripts/gen_figures.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_figures", ROOT / "scripts/gen_figures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for page in module.PAGES:
        assert module.render(page.read_text()) == page.read_text(), page


CONSUMER_MODULES = [
    "oncely.consumers",
    "oncely.consumers.producer",
    "oncely.consumers.rabbitmq",
    "oncely.consumers.kafka",
    "oncely.consumers.nats",
    "oncely.consumers.redis_streams",
    "oncely.consumers.faststream",
    "oncely.consumers.celery",
]


@pytest.mark.parametrize("module_name", CONSUMER_MODULES)
def test_the_reference_covers_every_consumer_class_and_parameter(module_name: str) -> None:
    """Each public class and function of the consumers, and each of a class's constructor
    parameters, is listed."""
    import enum
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    reference = (ROOT / "docs/reference.md").read_text()
    section = reference.split(f"## `{module_name}`\n", 1)[1].split("\n## ", 1)[0]
    public = [getattr(module, name) for name in module.__all__]
    functions = [obj for obj in public if inspect.isfunction(obj)]
    classes = [obj for obj in public if inspect.isclass(obj)]
    assert classes or functions
    for function in functions:
        assert f"### function `{function.__name__}(" in section
    for cls in classes:
        assert f"### class `{cls.__name__}" in section
        if issubclass(cls, (enum.Enum, BaseException)):
            continue
        heading = section.split(f"### class `{cls.__name__}", 1)[1].split("\n", 1)[0]
        for parameter in inspect.signature(cls).parameters:
            assert f"{parameter}" in heading, (cls, parameter)


def test_the_reference_covers_every_cli_command_and_option() -> None:
    """`oncely` and each subcommand appear with every option they take."""
    import click

    from oncely.cli._app import cli

    reference = (ROOT / "docs/reference.md").read_text()
    section = reference.split("## The `oncely` command\n", 1)[1]
    root = click.Context(cli, info_name="oncely")
    commands: list[tuple[str, click.Command]] = [("oncely", cli)]
    commands += [(f"oncely {name}", cli.commands[name]) for name in cli.list_commands(root)]
    assert len(commands) > 5
    for title, command in commands:
        text = section.split(f"### `{title}`\n", 1)[1].split("\n### ", 1)[0]
        for parameter in command.params:
            names = parameter.opts if isinstance(parameter, click.Option) else [parameter.name]
            for name in names:
                assert (name or "").upper() in text.upper(), (title, name)
