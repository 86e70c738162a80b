"""The Lua code, one function per transition, and the flows that call them.

``lua/record.lua`` holds the shared helpers; each transition's own file is the body of one Lua
function. They run as one function library (`library`: ``FCALL``), or, on a server without
functions, as one script per transition (`sources`: ``EVALSHA``); `Scripts` loads what a server
lacks. A flow (`oncely._core.flow`) yields one `ScriptCall` and decodes the reply, so every store
operation is written once for both worlds and costs exactly one round trip.

The batch verbs run ``claim_many`` and ``complete_many``: the same transition functions, which
``lua/batch.lua`` calls once per item. Their flows yield one `BatchCall`, which the store
performs as one call (one per slot on a cluster: `BatchCall.split`).

The store has redis-py re-send a command after a connection error or a timeout, so a script
may run twice for one call whose first reply was lost. Every claim, complete,
fail and release therefore carries an id of its own (`call_id`), which the script stores in the
record: a re-sent call that finds its own effect answers as the first run did (its own lease is
Acquired, not InProgress; its own completion is done, not LeaseLost). An extend re-run only
moves the lease again.
"""

from __future__ import annotations

import functools
import hashlib
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
    "ENTRIES",
    "NAMES",
    "BatchCall",
    "ScriptCall",
    "Scripts",
    "call_id",
    "claim_args",
    "claim_many",
    "complete_many",
    "extend",
    "finish_args",
    "get",
    "library",
    "release",
    "sources",
]

_T = TypeVar("_T")

NAMES: Final = ("claim", "complete", "fail", "release", "extend", "get", "forget")
"""Every single-item script, by the name of its file in ``lua/``."""

BATCHES: Final = {"claim_many": "claim", "complete_many": "complete"}
"""Every batch script, with the transition it runs for each item."""


ENTRIES: Final = (*NAMES, *BATCHES)
"""Every entry point: the single-item transitions and the batches."""

_SCRIPT_HEAD: Final = """\
-- Redis < 5 replicates scripts verbatim unless told to replicate their effects (TIME is not
-- deterministic); from 5 on this is the default and the call is a no-op.
if redis.replicate_commands then redis.replicate_commands() end
"""


@functools.cache
def _read(name: str) -> str:
    folder = resources.files("oncely.stores.redis").joinpath("lua")
    return folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")


@functools.cache
def _definitions() -> Mapping[str, str]:
    """Each entry point as a Lua ``local function <name>(KEYS, ARGV)``, by name."""
    texts = {name: f"local function {name}(KEYS, ARGV)\n{_read(name)}\nend\n" for name in NAMES}
    for batch, name in BATCHES.items():
        loop = _read("batch")
        texts[batch] = f"local function {batch}(KEYS, ARGV)\nlocal one = {name}\n{loop}\nend\n"
    return texts


@functools.cache
def sources() -> Mapping[str, str]:
    """Return the full text of every entry point as a script of its own (EVALSHA), by name."""
    shared, functions = _read("record"), _definitions()
    texts = {}
    for name in ENTRIES:
        needed = [functions[name]] if name in NAMES else [functions[BATCHES[name]], functions[name]]
        texts[name] = "\n".join([_SCRIPT_HEAD, shared, *needed, f"return {name}(KEYS, ARGV)\n"])
    return texts


@functools.cache
def library() -> tuple[str, Mapping[str, str]]:
    """Return every entry point as one function library: its code (for ``FUNCTION LOAD``), and
    each entry point's function name (for ``FCALL``).

    The library's name holds a digest of its code, so that the libraries of two oncely versions
    live side by side on one server (a rolling upgrade). Each function forgets the clock of the
    call before it (record.lua's ``clock``, read once per call) and runs its entry point.
    """
    body = "\n".join([_read("record"), *_definitions().values()])
    name = f"oncely_{hashlib.sha1(body.encode()).hexdigest()[:16]}"
    functions = {entry: f"{name}_{entry}" for entry in ENTRIES}
    register = "".join(
        f"redis.register_function('{function}', "
        f"function(KEYS, ARGV) clock = nil return {entry}(KEYS, ARGV) end)\n"
        for entry, function in functions.items()
    )
    return f"#!lua name={name}\n{body}\n{register}", functions


class Scripts:
    """oncely's scripts on one redis-py client, and how to run them.

    Each call is one ``FCALL`` of a function of `library`: its helpers are made once, when the
    library is loaded, where a script (``EVALSHA``) makes them again on every call. A call
    that finds the library missing (a new server, ``FUNCTION FLUSH``, a restart without
    persistence) loads it (on every primary of a cluster) and runs again: see `recover`. A
    server that has no functions (Redis < 7, or a proxy or an ACL that refuses them) gets
    ``EVALSHA`` from then on, which reloads a script after ``NOSCRIPT``.

    Attributes:
        client: The redis-py client (sync or async) that runs the calls.
        heads: The command, and the function name or script digest, of each entry point.
    """

    __slots__ = ("_errors", "client", "heads")

    def __init__(self, client: Any, errors: Any) -> None:
        self.client = client
        self._errors = errors  # redis.exceptions
        functions = library()[1]
        self.heads: Mapping[str, tuple[str, str]] = {
            entry: ("FCALL", function) for entry, function in functions.items()
        }

    @property
    def functions(self) -> bool:
        """Whether the calls go as ``FCALL`` (``EVALSHA`` once the server refused functions)."""
        return self.heads is not _evalsha_heads()

    def command(self, entry: str, keys: Sequence[bytes], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command that runs *entry* on *keys* with *args*."""
        return (*self.heads[entry], len(keys), *keys, *args)

    def recover(
        self, entry: str, keys: Sequence[bytes], args: Sequence[Any], error: BaseException
    ) -> Flow[Any]:
        """After the command of *entry* failed with *error*: load what the server lacks and run
        it again, or run it as a script, or raise *error*. Yields commands, returns the reply.

        Each error handled here is one the server answers before it runs anything, so running
        the call again cannot apply it twice.
        """
        errors = self._errors
        if self.functions:
            message = str(error)
            if message.startswith("Function not found"):
                try:
                    yield ("FUNCTION", "LOAD", "REPLACE", library()[0])
                except errors.ResponseError as exc:
                    if not _refuses_functions(str(exc)):
                        raise
                    self.heads = _evalsha_heads()
                else:
                    return (yield self.command(entry, keys, args))
            elif _refuses_functions(message):
                self.heads = _evalsha_heads()
            elif "command not allowed when used memory" not in message:
                raise error
            # Past maxmemory, a function that may write is refused before it runs; a script
            # runs and has only its writes refused, so a replay is still answered: this call
            # runs as a script.
        elif isinstance(error, errors.NoScriptError):
            yield ("SCRIPT", "LOAD", sources()[entry])
            return (yield self.command(entry, keys, args))
        else:
            raise error
        command = (*_evalsha_heads()[entry], len(keys), *keys, *args)
        try:
            return (yield command)
        except errors.NoScriptError:
            yield ("SCRIPT", "LOAD", sources()[entry])
            return (yield command)


def _refuses_functions(message: str) -> bool:
    """Whether the error *message* says that functions cannot run here (not that one failed)."""
    text = message.lower()
    if "unknown command" in text or "unsupported command" in text:
        return True
    return "no permissions" in text and ("'fcall'" in text or "'function" in text)


@functools.cache
def _evalsha_heads() -> Mapping[str, tuple[str, str]]:
    return {
        entry: ("EVALSHA", hashlib.sha1(text.encode()).hexdigest())
        for entry, text in sources().items()
    }


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


@functools.lru_cache(maxsize=256)
def _claim_times(lease: timedelta, ttl: timedelta) -> tuple[int, int]:
    """The lease, and how long `claim.lua` keeps a record past it (max(ttl, lease)), in ms."""
    lease_ms = _ms(lease)
    return lease_ms, max(_ms(ttl), lease_ms)


def claim_args(fingerprint: str, lease: timedelta, ttl: timedelta) -> tuple[str, int, int, str]:
    """The ``ARGV`` of `claim.lua`, whose reply `_codec.claim_answer` reads. The store runs
    its claim (and its complete and fail) without a flow: they are every call's."""
    lease_ms, margin_ms = _claim_times(lease, ttl)
    return (fingerprint, lease_ms, margin_ms, call_id())


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
    lease_ms, margin_ms = _claim_times(lease, ttl)
    items = tuple(
        ScriptCall("claim", key, space.name(key), (fingerprint, lease_ms, margin_ms, str(op)))
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
