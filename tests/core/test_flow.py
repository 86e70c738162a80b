"""drive() and adrive() run the same flow with the same outcome, errors included."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from oncely._core.flow import Flow, adrive, drive


def flow() -> Flow[list[Any]]:
    seen = []
    seen.append((yield "double 2"))
    try:
        yield "fail"
    except RuntimeError as exc:
        seen.append(f"caught {exc}")
    seen.append((yield "double 5"))
    return seen


def perform(op: str) -> int:
    if op == "fail":
        raise RuntimeError("boom")
    return int(op.split()[1]) * 2


async def aperform(op: str) -> int:
    await asyncio.sleep(0)
    return perform(op)


def test_sync_and_async_drivers_agree() -> None:
    """Results are sent back and errors thrown into the flow at the yield that caused them."""
    expected = [4, "caught boom", 10]
    assert drive(flow(), perform) == expected
    assert asyncio.run(adrive(flow(), aperform)) == expected


def test_unhandled_errors_propagate() -> None:
    """An error the flow does not catch reaches the caller unchanged."""

    def failing() -> Flow[None]:
        yield "fail"

    with pytest.raises(RuntimeError, match="boom"):
        drive(failing(), perform)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(adrive(failing(), aperform))
