"""The reference-flows switch: with it, the fast paths run the flows they copy instead."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

import oncely
from oncely import _switches
from oncely._core.flow import Flow
from oncely._execution import drivers, fast
from oncely.stores.memory import MemoryStore


class _Spied:
    """Counts the flows `call`/`acall` start, and the operations `aperform` performs (the
    reference driver's only way to perform one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.protected = 0
        self.performed = 0
        protected_call, aperform = fast.protected_call, drivers.aperform

        def counted_protected_call(*args: Any) -> Flow[Any]:
            self.protected += 1
            return protected_call(*args)

        async def counted_aperform(op: Any, store: Any, invoke: Any = None) -> Any:
            self.performed += 1
            return await aperform(op, store, invoke)

        monkeypatch.setattr(fast, "protected_call", counted_protected_call)
        monkeypatch.setattr(drivers, "aperform", counted_aperform)


def _decorated() -> tuple[Any, Any]:
    store = MemoryStore()

    @oncely.idempotent(store=store, key="key")
    def double(key: str, value: int) -> int:
        return value * 2

    @oncely.idempotent(store=store, key="key")
    async def adouble(key: str, value: int) -> int:
        return value * 2

    return double, adouble


@pytest.mark.parametrize("switched", [False, True], ids=["fast", "reference"])
def test_the_switch_decides_which_path_a_decorated_call_takes(
    monkeypatch: pytest.MonkeyPatch, switched: bool
) -> None:
    monkeypatch.setattr(_switches, "reference_flows", switched)
    spied = _Spied(monkeypatch)
    double, adouble = _decorated()

    assert [double("a", 2), double("a", 2)] == [4, 4]  # a new key, then its replay
    assert spied.protected == (2 if switched else 0)

    async def twice() -> list[int]:
        return [await adouble("b", 3), await adouble("b", 3)]

    assert asyncio.run(twice()) == [6, 6]
    assert spied.protected == (4 if switched else 0)
    # The straight line performs no operation of a flow; the flows perform each of theirs.
    assert (spied.performed > 0) is switched


def test_the_environment_variable_sets_the_switch() -> None:
    code = "from oncely import _switches; print(_switches.reference_flows)"
    env = {**os.environ, _switches.REFERENCE_FLOWS_VARIABLE: "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
