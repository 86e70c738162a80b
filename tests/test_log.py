"""oncely's log lines: every interpolated value is escaped, so one call is one line."""

from __future__ import annotations

import logging

import pytest

from oncely._log import escape, get_logger


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
