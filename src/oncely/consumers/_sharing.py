"""The sharing of copies of one key between the flows of one async run (a Kafka member's
partitions of one poll): a copy in another flow runs under the lease claimed for it, or waits
for that run, rather than finding the key busy and retrying after a delay."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from oncely import _execution
from oncely._core.flow import Flow


@dataclass(slots=True, eq=False)
class Slot:
    """One key that the flows of one async run (`arun_with`; a Kafka member's partitions of one
    poll) claim at once: the lease of the flow that got it, until that flow or another one
    starts running it, so that a copy in another partition runs under it or waits for it
    rather than finding the key busy (and retrying after a delay)."""

    done: asyncio.Future[None]
    """Done once the key is decided here (its completion landed, or nobody runs it now)."""
    flows: int = 0
    """The flows that claimed the key (more than one: an in-progress answer may be theirs)."""
    claiming: int = 0
    """The flows whose claim has not answered yet."""
    owned: bool = False
    """Whether one flow of the run got the lease."""
    fingerprint: str | None = None
    """The fingerprint it was claimed with (a copy with another one does not take it)."""
    lease: _execution.Lease | None = None
    """The lease, while nobody has started running it."""
    taken: _execution.Lease | None = None
    """The lease, once another flow than its claimer took it (that flow stops its beat)."""

    def decide(self, *_: Any) -> None:
        if not self.done.done():
            self.done.set_result(None)


@dataclass(frozen=True, slots=True, eq=False)
class Later:
    """A delivery whose claim answered in progress while another flow of the run claimed its
    key: run by `IdempotentConsumer._later`."""

    key: str
    fingerprint: str
    slot: Slot


@dataclass(frozen=True, slots=True, eq=False)
class Share:
    """The `Slot` of each of *keys*, shared with the other flows of the run that claim them
    (none with a sync store: its flows run one after the other)."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Wait:
    """Wait until *slot* is decided, at most *timeout* seconds."""

    slot: Slot
    timeout: float


@dataclass(frozen=True, slots=True, eq=False)
class Decide:
    """Mark these slots decided: their copies need not wait any longer."""

    slots: Sequence[Slot]


def withdrawn(
    run: _execution.Lease | Later, slots: Mapping[str, Slot]
) -> TypeGuard[_execution.Lease]:
    """Take back *run*, a lease of this flow that no other flow has started; whether it was
    (a `Later` is not this flow's)."""
    if not isinstance(run, _execution.Lease):
        return False
    slot = slots.get(run.key)
    if slot is None:
        return True
    if slot.lease is run:
        slot.lease = None
        return True
    return False


def decided(slot: Slot | None) -> Flow[None]:
    if slot is not None:
        yield Decide((slot,))
