"""Nonsense store URLs are ConfigurationErrors at `oncely.open_store`, never a store that
misbehaves later or an outage reported at the first call."""

from __future__ import annotations

from pathlib import Path

import pytest

import oncely
from oncely.errors import ConfigurationError
from oncely.stores.sqlite import SQLiteStore


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://foo", "memory:// takes no host, path or parameters"),
        ("memory:///x", "memory:// takes no host, path or parameters"),
        ("memory://?max=1", "memory:// takes no host, path or parameters"),
        ("tiered+memory://foo", "memory:// takes no host, path or parameters"),
        ("tiered+tiered+memory://", "a tiered store in front of a tiered store"),
        ("tiered+tiered+sqlite:///x.db", "a tiered store in front of a tiered store"),
    ],
)
def test_nonsense_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        oncely.open_store(url)


def test_sqlite_file_in_a_missing_folder_is_a_configuration_error(tmp_path: Path) -> None:
    """The folder is named, at open, rather than 'unable to open database file' as an outage
    (StoreUnavailableError) at the first call."""
    missing = tmp_path / "no" / "such"
    with pytest.raises(ConfigurationError, match=r"folder .* does not exist") as raised:
        oncely.open_store(f"sqlite:///{missing}/oncely.db")
    assert str(missing) in str(raised.value)
    with pytest.raises(ConfigurationError, match="does not exist"):
        SQLiteStore(missing / "oncely.db")
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigurationError, match="is not a folder"):
        SQLiteStore(file / "oncely.db")


def test_the_memory_url_and_an_existing_folder_open(tmp_path: Path) -> None:
    for url in ("memory://", "tiered+memory://", f"sqlite:///{tmp_path}/oncely.db"):
        with oncely.open_store(url) as store:
            assert store.check().backend in ("memory", "sqlite", "tiered")


@pytest.mark.parametrize(
    "options",
    [
        {"timeout": -1},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"timeout": "30"},
        {"async_workers": 0},
        {"async_workers": True},
    ],
)
def test_nonsense_sqlite_options_are_configuration_errors(
    options: dict[str, object], tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError):
        SQLiteStore(tmp_path / "oncely.db", **options)  # type: ignore[arg-type]
    url_options = "&".join(f"{name}={value}" for name, value in options.items())
    if "timeout" in options and isinstance(options["timeout"], float):
        with pytest.raises(ConfigurationError):
            oncely.open_store(f"sqlite:///{tmp_path}/oncely.db?{url_options}")
