"""What the demos share: their option checks, output, and the worker log bridge."""

from __future__ import annotations

import argparse
import hashlib
import logging
from typing import Any, Protocol

__all__ = [
    "DemoAborted",
    "PipeLogHandler",
    "fraction",
    "positive_int",
    "rate_below_one",
    "render_table",
    "say",
]


class _Sends(Protocol):
    def send(self, kind: str, **fields: Any) -> None: ...


def fraction(seed: int, label: str) -> float:
    digest = hashlib.blake2b(f"{seed}:{label}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class PipeLogHandler(logging.Handler):
    """Forwards the ``oncely`` logger's lines to the parent, which prints them."""

    def __init__(self, worker: _Sends) -> None:
        super().__init__(logging.WARNING)
        self.worker = worker

    def emit(self, record: logging.LogRecord) -> None:
        """Send one log line."""
        try:
            self.worker.send("log", text=f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:
            self.handleError(record)


class DemoAborted(Exception):
    """The storm could not finish (a worker failed for a reason other than an injected crash)."""


def say(line: str) -> None:
    print(line, flush=True)


def render_table(rows: list[tuple[str, str, str]]) -> str:
    """A compact, aligned table: label, value, note."""
    label_width = max(len(label) for label, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    return "\n".join(
        f"  {label:<{label_width}}  {value:>{value_width}}  {note}".rstrip()
        for label, value, note in rows
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def rate_below_one(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, not {value}")
    return value
