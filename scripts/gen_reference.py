"""Write docs/reference.md from the public API's docstrings (checked by tests/test_docs.py)."""

from __future__ import annotations

import enum
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

SECTIONS = [
    ("oncely", None),
    ("oncely.keys", None),
    ("oncely.testing", ["override_store", "disabled", "FrozenClock", "StoreConformance"]),
    ("oncely.stores", ["MemoryStore", "SQLiteStore"]),
    ("oncely.stores.tiered", ["TieredStore"]),
    ("oncely.stores.bloom", ["BloomStore"]),
    ("oncely.dashboard", None),
    ("oncely.http", None),
    ("oncely.http.asgi", ["IdempotencyMiddleware"]),
    ("oncely.http.wsgi", ["IdempotencyMiddleware"]),
    ("oncely.http.flask", ["Idempotency"]),
    ("oncely.http.django", ["IdempotencyMiddleware"]),
    ("oncely.http.fastapi", None),
    ("oncely.inbox", ["InboxEntry", "AsyncInboxEntry"]),
    ("oncely.aggregates", None),
    ("oncely.outbox", None),
    ("oncely.consumers", None),
    ("oncely.observe", None),
]
OPTIONAL = [
    ("oncely.observe.prometheus", ["install", "uninstall"]),
    ("oncely.observe.otel", ["install", "uninstall"]),
    ("oncely.bloom", None),
    ("oncely.stores.postgres", ["PostgresStore"]),
    ("oncely.stores.redis", ["RedisStore", "RedisClusterStore"]),
    (
        "oncely.http.client",
        ["IdempotentTransport", "AsyncIdempotentTransport", "OutcomeUnknownError"],
    ),
    ("oncely.consumers.producer", None),
    ("oncely.consumers.rabbitmq", None),
    ("oncely.consumers.kafka", None),
    ("oncely.consumers.nats", None),
    ("oncely.consumers.redis_streams", None),
    ("oncely.consumers.faststream", None),
    ("oncely.consumers.celery", None),
]
HELP_WIDTH = 100
"""The width the CLI's help is rendered at, so the reference is the same on every terminal."""
OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


class _Shown:
    """A default value shown the same way on every run (no addresses, no set order)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        value = self.value
        if isinstance(value, (set, frozenset)):
            items = ", ".join(sorted(repr(item) for item in value))
            return f"{type(value).__name__}({{{items}}})"
        if callable(value) and hasattr(value, "__qualname__"):
            return str(value.__qualname__)
        return repr(value)


def _signature(obj: Any) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parameters = [
        parameter
        if parameter.default is inspect.Parameter.empty
        else parameter.replace(default=_Shown(parameter.default))
        for parameter in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters))


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _members(cls: type) -> list[str]:
    """The public methods and properties of *cls*; for `StoreConformance`, with the tests it
    inherits from its parts (one class per verb group, in private modules)."""
    lines = []
    seen: set[str] = set()
    owners = [
        owner
        for owner in cls.__mro__
        if owner is cls or owner.__module__.startswith("oncely.testing._")
    ]
    for name, member in [pair for owner in owners for pair in vars(owner).items()]:
        if name in seen:
            continue
        seen.add(name)
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        target = member.fget if isinstance(member, property) else member
        doc = _doc(target).split("\n\n")[0].replace("\n", " ")
        signature = "" if isinstance(member, property) else _signature(member)
        lines.append(f"- `{name}{signature}`: {doc}")
    return lines


def render() -> str:
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python scripts/gen_reference.py`; do not edit.",
        "",
    ]
    sections = list(SECTIONS)
    for module_name, names in OPTIONAL:
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue
        sections.append((module_name, names))
    for module_name, names in sections:
        module = importlib.import_module(module_name)
        out += [f"## `{module_name}`", ""]
        if names is None:
            doc = _doc(module).split("\n\n")[0]
            out += [doc, ""]
            names = list(module.__all__)
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            is_enum = inspect.isclass(obj) and issubclass(obj, enum.Enum)
            signature = "" if is_enum else _signature(obj)  # an enum is not constructed
            out += [f"### {kind} `{name}{signature}`", ""]
            doc = _doc(obj)
            if doc:
                out += [doc, ""]
            if is_enum:
                out += [", ".join(f"`{member.name}`" for member in obj), ""]
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                members = _members(obj)
                if members:
                    out += [*members, ""]
    out += _cli()
    return "\n".join(out).rstrip() + "\n"


def _cli() -> list[str]:
    """The ``oncely`` command's help and each subcommand's, as click renders them."""
    try:
        import click

        from oncely.cli._app import cli
    except ImportError:  # the cli extra is not installed
        return []
    out = [
        "## The `oncely` command",
        "",
        "Every command and option, as `oncely --help` and `oncely COMMAND --help` print them.",
        "",
    ]
    root = click.Context(cli, info_name="oncely", terminal_width=HELP_WIDTH)
    commands = [("oncely", cli, root)]
    for title, command, context in commands:  # grows: a group's commands follow it
        if not isinstance(command, click.Group):
            continue
        for name in command.list_commands(context):
            sub = command.get_command(context, name)
            if sub is not None:
                sub_context = click.Context(
                    sub, info_name=name, parent=context, terminal_width=HELP_WIDTH
                )
                commands.append((f"{title} {name}", sub, sub_context))
    for title, command, context in commands:
        out += [f"### `{title}`", "", "```text", command.get_help(context), "```", ""]
    return out


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUTPUT.read_text() == text else "docs/reference.md is out of date")
    OUTPUT.write_text(text)
