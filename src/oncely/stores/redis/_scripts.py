"""The Lua scripts, one per transition, and the flows that call them.

Each script is ``lua/record.lua`` (shared helpers) followed by the transition's own file. A flow
(`oncely._core.flow`) yields one `ScriptCall` and decodes the reply, so every store operation is
written once for both worlds and costs exactly one round trip: the store registers the scripts
once per client (``register_script``: EVALSHA, loading the script again on NOSCRIPT).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from importlib import resources
from typing import Final

from oncely._core.flow import Flow
from oncely._core.records import ClaimResult, LeaseLost, Record
from oncely.stores._machine import _ms
from oncely.stores.redis import _codec
from oncely.stores.redis._codec import Keyspace

__all__ = ["NAMES", "ScriptCall", "claim", "extend", "finish", "get", "release", "sources"]

NAMES: Final = ("claim", "complete", "fail", "release", "extend", "get")
"""Every script, by the name of its file in ``lua/``."""


@functools.cache
def sources() -> Mapping[str, str]:
    """Return the full text of every script, by name."""
    folder = resources.files("oncely.stores.redis").joinpath("lua")
    shared = folder.joinpath("record.lua").read_text(encoding="utf-8")
    return {
        name: shared + "\n" + folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        for name in NAMES
    }


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """Run *script* on the record hash *record* with *args*: one round trip.

    Attributes:
        script: The script's name (a key of `sources`).
        key: The caller's key, for error messages.
        record: The name of the record's hash (``KEYS[1]``).
        args: The script's ``ARGV``.
    """

    script: str
    key: str
    record: bytes
    args: tuple[bytes | str | int, ...] = ()


def claim(
    space: Keyspace, key: str, fingerprint: str, lease: timedelta, ttl: timedelta
) -> Flow[ClaimResult]:
    """Claim *key*: see `claim.lua`."""
    call = ScriptCall("claim", key, space.name(key), (fingerprint, _ms(lease), _ms(ttl)))
    return _codec.claim_answer(key, (yield call))


def finish(
    space: Keyspace, verb: str, key: str, token: int, outcome: bytes, ttl: timedelta
) -> Flow[LeaseLost | None]:
    """Complete or fail (*verb*) the lease *token* holds on *key*: see `complete.lua`."""
    call = ScriptCall(verb, key, space.name(key), (token, bytes(outcome), _ms(ttl)))
    return _codec.settle_answer(key, (yield call))


def release(space: Keyspace, key: str, token: int) -> Flow[LeaseLost | None]:
    """Give up the lease *token* holds on *key*: see `release.lua`."""
    return _codec.settle_answer(key, (yield ScriptCall("release", key, space.name(key), (token,))))


def extend(space: Keyspace, key: str, token: int, lease: timedelta) -> Flow[LeaseLost | None]:
    """Move the end of the lease *token* holds on *key*: see `extend.lua`."""
    call = ScriptCall("extend", key, space.name(key), (token, _ms(lease)))
    return _codec.settle_answer(key, (yield call))


def get(space: Keyspace, key: str) -> Flow[Record | None]:
    """Read *key*'s live record: see `get.lua`."""
    return _codec.record_or_none(key, (yield ScriptCall("get", key, space.name(key))))
