"""The Lua scripts, one per transition, and the flows that call them.

Each script is ``lua/record.lua`` (shared helpers) followed by the transition's own file. A flow
(`oncely._core.flow`) yields one `ScriptCall` and decodes the reply, so every store operation is
written once for both worlds and costs exactly one round trip: the store registers the scripts
once per client (``register_script``: EVALSHA, loading the script again on NOSCRIPT).

The batch verbs run ``claim_many`` and ``complete_many``: the same transition files, each
wrapped in a function that ``lua/batch.lua`` calls once per item. Their flows yield one
`BatchCall`, which the store performs as one EVALSHA (one per slot on a cluster: `BatchCall.split`).

The store has redis-py re-send a command after a connection error or a timeout, so a script
may run twice for one call whose first reply was lost. Every claim, complete,
fail and release therefore carries an id of its own (`call_id`), which the script stores in the
record: a re-sent call that finds its own effect answers as the first run did (its own lease is
Acquired, not InProgress; its own completion is done, not LeaseLost). An extend re-run only
moves the lease again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from importlib import resources
from random import getrandbits
from typing import Any, Final, TypeVar

from oncely._core.flow import Flow
from oncely._core.records import ClaimResult, LeaseLost, Record, Status
from oncely.errors import StoreError
from oncely.stores._batch import call_ids
from oncely.stores._machine import _ms
from oncely.stores.redis import _codec
from oncely.stores.redis._codec import Keyspace

__all__ = [
    "BATCHES",
    "NAMES",
    "BatchCall",
    "ScriptCall",
    "call_id",
    "claim_args",
    "claim_many",
    "complete_many",
    "extend",
    "finish_args",
    "get",
    "release",
    "sources",
]

_T = TypeVar("_T")

NAMES: Final = ("claim", "complete", "fail", "release", "extend", "get", "forget")
"""Every single-item script, by the name of its file in ``lua/``."""

BATCHES: Final = {"claim_many": "claim", "complete_many": "complete"}
"""Every batch script, with the transition it runs for each item."""


@functools.cache
def sources() -> Mapping[str, str]:
    """Return the full text of every script, single-item and batch, by name."""
    folder = resources.files("oncely.stores.redis").joinpath("lua")

    def read(name: str) -> str:
        return folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")

    shared, loop = read("record"), read("batch")
    texts = {name: f"{shared}\n{read(name)}" for name in NAMES}
    for batch, name in BATCHES.items():
        texts[batch] = f"{shared}\nlocal function one(KEYS, ARGV)\n{read(name)}\nend\n\n{loop}"
    return texts


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """Run *script* on the record *record* with *args*: one round trip.

    Attributes:
        script: The script's name (a key of `sources`).
        key: The caller's key, for error messages.
        record: The name of the record's key (``KEYS[1]``).
        args: The script's ``ARGV``.
    """

    script: str
    key: str
    record: bytes
    args: tuple[bytes | str | int, ...] = ()


def call_id() -> str:
    """A new id for one call: unique across calls, processes and hosts (64 random bits).

    From `random`, whose generator is seeded from the OS and seeded again in a forked child: a
    call id needs to be unique, not secret, and ``secrets`` costs a system call per call.
    """
    return f"{getrandbits(64):016x}"


def claim_args(fingerprint: str, lease: timedelta, ttl: timedelta) -> tuple[str, int, int, str]:
    """The ``ARGV`` of `claim.lua`, whose reply `_codec.claim_answer` reads. The store runs
    its claim (and its complete and fail) without a flow: they are every call's."""
    return (fingerprint, _ms(lease), _ms(ttl), call_id())


def finish_args(token: int, outcome: bytes, ttl: timedelta) -> tuple[int, bytes, int, str]:
    """The ``ARGV`` of `complete.lua` and `fail.lua`, whose reply `_codec.settle_answer`
    reads."""
    return (token, bytes(outcome), _ms(ttl), call_id())


def release(space: Keyspace, key: str, token: int) -> Flow[LeaseLost | None]:
    """Give up the lease *token* holds on *key*: see `release.lua`."""
    call = ScriptCall("release", key, space.name(key), (token, call_id()))
    return _codec.settle_answer(key, (yield call))


def extend(space: Keyspace, key: str, token: int, lease: timedelta) -> Flow[LeaseLost | None]:
    """Move the end of the lease *token* holds on *key*: see `extend.lua`."""
    call = ScriptCall("extend", key, space.name(key), (token, _ms(lease)))
    return _codec.settle_answer(key, (yield call))


def forget(space: Keyspace, key: str, force: bool) -> Flow[tuple[Status | None, bool]]:
    """Make *key*'s finished record a tombstone: see `forget.lua`. Answers (the status it had,
    whether it was refused)."""
    reply = yield ScriptCall("forget", key, space.name(key), (1 if force else 0,))
    return _codec.forget_answer(key, reply)


def get(space: Keyspace, key: str) -> Flow[Record | None]:
    """Read *key*'s live record: see `get.lua`."""
    return _codec.record_or_none(key, (yield ScriptCall("get", key, space.name(key))))


# -- batches -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchCall:
    """Run the batch *script* over *items* (`ScriptCall` of one transition each), in order.

    The reply is one reply per item; `split` divides a batch among cluster slots and `merge`
    puts the parts' replies back in the items' order.

    Attributes:
        script: The batch script's name (a key of `BATCHES`).
        items: One call per item; their ``args`` all have the same length.
    """

    script: str
    items: tuple[ScriptCall, ...]

    @property
    def key(self) -> str:
        """The first item's key, for the messages of errors that fail the whole call."""
        return self.items[0].key

    @property
    def keys(self) -> list[bytes]:
        """The script's ``KEYS``: every item's record."""
        return [item.record for item in self.items]

    @property
    def args(self) -> list[bytes | str | int]:
        """The script's ``ARGV``: every item's arguments, item after item."""
        return [arg for item in self.items for arg in item.args]

    def split(self, slot: Callable[[bytes], int]) -> list[tuple[list[int], BatchCall]]:
        """Group the items by ``slot(record)``: each group, with its items' positions."""
        groups: dict[int, list[int]] = {}
        for index, item in enumerate(self.items):
            groups.setdefault(slot(item.record), []).append(index)
        return [
            (indices, BatchCall(self.script, tuple(self.items[i] for i in indices)))
            for indices in groups.values()
        ]

    def merge(self, parts: Sequence[tuple[list[int], list[Any] | StoreError]]) -> list[Any]:
        """Put the replies of the *parts* (or the error a part failed with) in item order.

        Raises:
            StoreError: Every part failed (the first part's error): the call failed as a whole.
        """
        failures = [reply for _, reply in parts if isinstance(reply, StoreError)]
        if failures and len(failures) == len(parts):
            raise failures[0]
        replies: list[Any] = [None] * len(self.items)
        for indices, reply in parts:
            if isinstance(reply, StoreError):
                for index in indices:
                    replies[index] = reply
            else:
                for index, one in zip(indices, reply, strict=True):
                    replies[index] = one
        return replies


def _each(decode: Callable[[str, Any], _T], call: BatchCall, replies: Any) -> list[_T | StoreError]:
    """Decode every item's reply; an item that failed alone is its `StoreError`, in its place."""
    if not isinstance(replies, list) or len(replies) != len(call.items):
        raise StoreError(
            f"unexpected reply from a Redis batch script for {len(call.items)} keys: "
            f"{replies!r:.200}",
            backend=_codec.BACKEND,
        )
    out: list[_T | StoreError] = []
    for item, reply in zip(call.items, replies, strict=True):
        if isinstance(reply, StoreError):  # its cluster slot's call failed (BatchCall.merge)
            out.append(reply)
            continue
        try:
            out.append(decode(item.key, reply))
        except StoreError as exc:
            out.append(exc)
    return out


def claim_many(
    space: Keyspace,
    requests: Sequence[tuple[str, str]],
    lease: timedelta,
    ttl: timedelta,
    ops: Sequence[str] | None = None,
) -> Flow[list[ClaimResult | StoreError]]:
    """Claim each ``(key, fingerprint)`` in order: see `batch.lua` and `claim.lua`.

    *ops*, one per request, are the claims' call ids (new ones when omitted): a caller that
    sends a batch again with the same ids gets its own applied claims back as `Acquired`.
    """
    ops = call_ids(requests, ops)
    lease_ms, ttl_ms = _ms(lease), _ms(ttl)
    items = tuple(
        ScriptCall("claim", key, space.name(key), (fingerprint, lease_ms, ttl_ms, str(op)))
        for (key, fingerprint), op in zip(requests, ops, strict=True)
    )
    if not items:
        return []
    call = BatchCall("claim_many", items)
    return _each(_codec.claim_answer, call, (yield call))


def complete_many(
    space: Keyspace, items: Sequence[tuple[str, int, bytes]], ttl: timedelta
) -> Flow[list[LeaseLost | StoreError | None]]:
    """Complete each ``(key, token, result)`` in order: see `batch.lua` and `complete.lua`."""
    ttl_ms = _ms(ttl)
    calls = tuple(
        ScriptCall("complete", key, space.name(key), (token, bytes(result), ttl_ms, call_id()))
        for key, token, result in items
    )
    if not calls:
        return []
    call = BatchCall("complete_many", calls)
    return _each(_codec.settle_answer, call, (yield call))
