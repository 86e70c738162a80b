"""scripts/test-floors tests the versions the extras in pyproject.toml admit at the lowest."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> dict[str, list[str]]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {
        name: re.findall(r'"([^"]+)"', requirements)
        for name, requirements in re.findall(r"^(\w+) = \[(.*)\]$", section, re.MULTILINE)
    }


def _pins() -> dict[str, str]:
    text = (ROOT / "scripts" / "test-floors").read_text()
    block = text.split("floors=(", 1)[1].split(")", 1)[0]
    return dict(re.findall(r'"([\w-]+)==([\w.]+)"', block))


def _floor(requirement: str) -> tuple[str, str]:
    match = re.fullmatch(r"([\w-]+)(?:\[[\w,]+\])?>=([\w.]+)", requirement)
    assert match is not None, requirement
    return match[1], match[2]


def _release(version: str) -> tuple[int, ...]:
    parts = [int(part) for part in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_floors_script_pins_the_extras_floors() -> None:
    """Every driver floor of the store and broker extras is what scripts/test-floors installs
    (the same release: 3.1 is 3.1.0), and the psycopg binary wheel matches psycopg."""
    extras = _extras()
    pins = _pins()
    requirements = [
        requirement
        for extra in ("redis", "postgres", "asyncpg", "rabbitmq", "kafka", "nats")
        for requirement in extras[extra]
        if not requirement.startswith("oncely[")  # the asyncpg extra includes postgres's
    ]
    floors = dict(_floor(requirement) for requirement in requirements)
    assert set(floors) == {
        "redis",
        "psycopg",
        "psycopg-pool",
        "asyncpg",
        "aio-pika",
        "confluent-kafka",
        "aiokafka",
        "nats-py",
    }, floors
    for name, version in floors.items():
        assert _release(pins[name]) == _release(version), (name, pins[name], version)
    assert pins["psycopg-binary"] == pins["psycopg"]
    # redis[hiredis] 5.3 requires hiredis>=3.0.0.
    assert floors["redis"] == "5.3"
    assert pins["hiredis"] == "3.0.0"


def test_the_supported_versions_table_says_the_extras_floors() -> None:
    """docs/guides/releasing.md names, for every driver an extra admits, the floor pyproject.toml
    declares, and names no other."""
    text = (ROOT / "docs" / "guides" / "releasing.md").read_text()
    table = text.split("<!-- supported-versions", 1)[1].split("<!-- /supported-versions -->")[0]
    documented = set(
        re.findall(r"^\| `(\w+)` \| ([\w-]+)[^|]*\| ([\w.]+) \|$", table, re.MULTILINE)
    )
    declared = {
        (extra, *_floor(requirement))
        for extra, requirements in _extras().items()
        if extra not in {"all", "bench", "dev", "demo", "pydantic", "testing"}
        for requirement in requirements
        if not requirement.startswith("oncely")
    }
    assert documented == declared
