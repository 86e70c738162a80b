"""oncely's log lines: every interpolated value is escaped, so one call is one line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from oncely import Guard, LeaseLostError, StoreUnavailableError, _execution
from oncely._log import escape, fields, get_logger
from oncely.consumers import Action, ConsumerPolicy, Delivery, IdempotentConsumer
from oncely.http import HttpPolicy, _flow
from oncely.http._semantics import Plan
from oncely.stores.memory import MemoryStore
from oncely.testing import FrozenClock


def test_escape_keeps_printable_text_and_escapes_the_rest() -> None:
    assert escape("POST /payments|order-7") == "POST /payments|order-7"
    assert escape("a\nCRITICAL b") == "a\\nCRITICAL b"
    assert escape("a\r\x1b[2Jb\u2028") == "a\\r\\x1b[2Jb\\u2028"
    assert escape("clé") == "clé"  # printable, only not ASCII


@pytest.fixture
def logger() -> logging.Logger:
    return get_logger("oncely.tests.log")


def test_every_argument_is_escaped(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info(
            "key=%s error=%s repr=%r n=%d t=%.1f",
            "k\nFORGED",
            ValueError("bad\nFORGED"),
            "x\ny",
            7,
            0.25,
        )
        logger.info("mapping %(key)s", {"key": "k\r\nFORGED"})
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "key=k\\nFORGED error=bad\\nFORGED repr='x\\ny' n=7 t=0.2",
        "mapping k\\r\\nFORGED",
    ]


def test_the_filter_is_attached_once() -> None:
    first = get_logger("oncely.tests.once")
    assert get_logger("oncely.tests.once") is first
    assert len(first.filters) == 1


class _Capture(logging.Handler):
    """Keeps every record oncely emits, as a JSON formatter or structlog would see it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def fields(self, starts: str) -> dict[str, object]:
        record = next(r for r in self.records if r.getMessage().startswith(starts))
        return {name: value for name, value in vars(record).items() if name.startswith("oncely_")}


@pytest.fixture
def capture() -> Iterator[_Capture]:
    handler = _Capture()
    root = logging.getLogger("oncely")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


class _DownOn(MemoryStore):
    """A memory store whose chosen verb finds the store unavailable."""

    def __init__(self, verb: str) -> None:
        super().__init__()
        self.verb = verb

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        if self.verb == "claim":
            raise StoreUnavailableError("down", backend="memory")
        return super().claim(*args, **kwargs)

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        if self.verb == "complete":
            raise StoreUnavailableError("down", backend="memory")
        return super().complete(*args, **kwargs)


def test_the_main_lines_carry_structured_fields(capture: _Capture) -> None:
    """Lease recovered, duplicate suppressed, lease lost, could not complete: fields in extra."""
    clock = FrozenClock()
    store = MemoryStore(clock=clock)
    with Guard(store, "order-7", scope="pay", lease=1, heartbeat=False) as first:
        clock.advance(timedelta(seconds=5))
        with Guard(store, "order-7", scope="pay", lease=60, heartbeat=False) as second:
            second.complete("ok")
        with pytest.raises(LeaseLostError):
            first.complete("late")
    with Guard(store, "order-7", scope="pay") as again:
        assert again.replayed
    assert capture.fields("lease recovered") == {
        "oncely_key": "pay|order-7",
        "oncely_scope": "pay",
        "oncely_token": 2,
        "oncely_attempt": 2,
        "oncely_outcome": "recovered",
    }
    assert capture.fields("lease lost") == {
        "oncely_key": "pay|order-7",
        "oncely_scope": "pay",
        "oncely_token": 1,
        "oncely_outcome": "lease_lost",
    }
    assert capture.fields("duplicate suppressed") == {
        "oncely_key": "pay|order-7",
        "oncely_scope": "pay",
        "oncely_token": 2,
        "oncely_outcome": "completed",
    }
    down = _DownOn("complete")
    with pytest.raises(StoreUnavailableError), Guard(down, "k", scope="pay", heartbeat=False):
        pass
    assert capture.fields("could not complete") == {
        "oncely_key": "pay|k",
        "oncely_scope": "pay",
        "oncely_token": 1,
        "oncely_outcome": "store_unavailable",
    }


def test_http_lines_carry_structured_fields(capture: _Capture) -> None:
    """Serving unprotected (fail-open) and answering 503 name the key and the outcome."""
    plan = Plan("POST /pay|k-1", "fp")
    for policy in (HttpPolicy(fail_open=True), HttpPolicy()):
        flow = _flow.begin(plan, policy, method="POST", path="/pay")
        _execution.run(flow, _DownOn("claim"))
    unprotected = {"oncely_key": "POST /pay|k-1", "oncely_scope": "POST /pay"}
    assert capture.fields("store unavailable, serving") == {
        **unprotected,
        "oncely_outcome": "unprotected",
    }
    assert capture.fields("store unavailable, answering 503") == {
        **unprotected,
        "oncely_outcome": "unavailable_503",
    }


def test_consumer_dead_letter_lines_carry_structured_fields(capture: _Capture) -> None:
    """A dead-lettered message names its key, the store and the outcome; escaped like the text."""
    consumer = IdempotentConsumer(MemoryStore(), scope="orders")
    body = json.dumps({"n": 1}).encode()
    verdict = consumer.process(Delivery(body, {"Idempotency-Key": "k\x01"}), lambda: None)
    assert verdict.action is Action.DEAD_LETTER
    assert capture.fields("message dead-lettered: no usable") == {
        "oncely_store": "MemoryStore",
        "oncely_outcome": "dead_lettered",
    }

    class Poison(Exception):
        pass

    def handler() -> None:
        raise Poison("bad")

    poisoned = IdempotentConsumer(
        MemoryStore(), scope="orders\nFORGED", policy=ConsumerPolicy(dead_letter_on=(Poison,))
    )
    verdict = poisoned.process(Delivery(body, {"Idempotency-Key": "k-2"}), handler)
    assert verdict.action is Action.DEAD_LETTER
    assert capture.fields("message dead-lettered: handler failed") == {
        "oncely_key": "orders\\nFORGED|k-2",
        "oncely_scope": "orders\\nFORGED",
        "oncely_attempt": 1,
        "oncely_store": "MemoryStore",
        "oncely_outcome": "dead_lettered",
    }


def test_fields_are_computed_only_when_the_level_is_enabled() -> None:
    """A disabled level reads nothing: the mapping is built lazily when a record is made."""
    made = fields(key="k", token=1)
    assert made._made is None  # type: ignore[attr-defined]  # the lazy cache, for this test
    quiet = get_logger("oncely.tests.quiet")
    quiet.setLevel(logging.WARNING)
    quiet.info("nothing %s", "k", extra=made)
    assert made._made is None  # type: ignore[attr-defined]
    quiet.warning("something %s", "k", extra=made)
    assert made._made == {"oncely_key": "k", "oncely_token": 1}  # type: ignore[attr-defined]


def test_every_module_logs_through_the_escaping_filter() -> None:
    """No module logs through a bare logging.getLogger, which would skip the escaping."""
    import importlib
    import pkgutil

    import oncely
    from oncely._log import _ESCAPE

    checked = []
    for info in pkgutil.walk_packages(oncely.__path__, "oncely."):
        if info.name.endswith("__main__"):  # importing it runs the command
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an extra that is not installed
            continue
        logger = getattr(module, "logger", None)
        if isinstance(logger, logging.Logger):
            checked.append(info.name)
            assert _ESCAPE in logger.filters, info.name
    assert "oncely.stores._coalesce" in checked
    assert "oncely.consumers.celery" in checked


def test_the_disabled_switch_names_the_scope(
    capture: _Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The UNPROTECTED warning of a disabled decorator carries the function's scope."""
    from oncely import _switches, idempotent

    monkeypatch.setattr(_switches, "disabled", True)

    @idempotent(store=MemoryStore(), key="order", scope="billing.charge")
    def charge(order: str) -> str:
        return order

    assert charge("o-1") == "o-1"
    assert capture.fields("oncely is DISABLED") == {
        "oncely_scope": "billing.charge",
        "oncely_outcome": "unprotected",
    }
