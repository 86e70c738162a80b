"""`Record` is a frozen dataclass whose constructor is written by hand (for speed)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from oncely._core.records import Record, Status


def _distinct() -> dict[str, object]:
    return {
        "key": "scope|k",
        "status": Status.COMPLETED,
        "fingerprint": "sha256:ab",
        "token": 2,
        "attempt": 3,
        "lease_expires_at_ms": 4,
        "expires_at_ms": 5,
        "created_at_ms": 6,
        "updated_at_ms": 7,
        "result": b"8",
    }


def test_every_field_gets_its_own_argument() -> None:
    values = _distinct()
    record = Record(**values)  # type: ignore[arg-type]
    assert {field.name: getattr(record, field.name) for field in dataclasses.fields(Record)} == (
        values
    )
    assert [field.name for field in dataclasses.fields(Record)] == list(values)


def test_result_defaults_to_none_and_arguments_are_keyword_only() -> None:
    values = _distinct()
    del values["result"]
    assert Record(**values).result is None  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Record(*values.values())  # type: ignore[misc]
    with pytest.raises(TypeError):
        Record(**{**values, "colour": "red"})  # type: ignore[arg-type]


def test_frozen_comparable_hashable_and_replaceable() -> None:
    record = Record(**_distinct())  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.token = 9  # type: ignore[misc]
    assert record == Record(**_distinct())  # type: ignore[arg-type]
    assert hash(record) == hash(Record(**_distinct()))  # type: ignore[arg-type]
    assert dataclasses.replace(record, token=9).token == 9
    assert pickle.loads(pickle.dumps(record)) == record
