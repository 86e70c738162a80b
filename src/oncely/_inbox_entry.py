"""The inbox's entries' shared state (`_EntryState`: the claim's answer, the result, the flows
to enter and leave) and the drivers' helpers (sleeping between attempts, the raw connection).
`oncely.inbox` builds `InboxEntry` and `AsyncInboxEntry` on them.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable
from typing import Any

from oncely import _events, _execution, _inbox_flow, _observed, _switches, _txn
from oncely._core.flow import Flow
from oncely._core.records import Acquired, Replay
from oncely.errors import InProgressError, OncelyError

_OPEN: contextvars.ContextVar[frozenset[tuple[int, str]]] = contextvars.ContextVar(
    "oncely_inbox_open", default=frozenset()
)
"""The (store, key) pairs whose blocks are running in this context: a block's own key claimed
again inside it is in progress. Its record is provisional (written complete with no outcome
yet, in the caller's transaction), so the database alone would replay it."""

_USER = "the inbox"

_UNPROTECTED = Acquired(token=0)
"""The claim of an entry under ``ONCELY_DISABLED``: held, never written."""


class _EntryState:
    """What the sync and async entries share: the plan, the claim's answer, the result."""

    def __init__(
        self,
        inbox: _inbox_flow.InboxView,
        plan: _inbox_flow.Plan,
        annotation: Any = Any,
        own: bool = False,
    ) -> None:
        self._inbox = inbox
        self._plan = plan
        self._own = own
        self._annotation = annotation
        self._acquired: Acquired | None = None
        self._replay: Replay | None = None
        self._value: Any = None
        self._mark = (id(inbox.store), plan.key)
        self._open = False

    @property
    def key(self) -> str:
        """The scoped key."""
        return self._plan.key

    @property
    def replayed(self) -> bool:
        """True when an earlier transaction committed this operation: use `result`."""
        return self._replay is not None

    @property
    def result(self) -> Any:
        """The committed outcome of the earlier transaction.

        Raises:
            OncelyError: This entry did not replay (it holds the claim).
            Exception: The final error the earlier transaction recorded, rebuilt as its type
                (one of ``final_errors``; any other stored error is `ResultUnavailableError`).
        """
        if self._replay is None:
            raise OncelyError("this entry holds the claim: there is no stored result to replay")
        return _execution.replay(
            self._replay, self._inbox.codec, self._annotation, self._inbox.policy
        )

    @property
    def token(self) -> int:
        """The fencing token of the claim."""
        if self._acquired is None:
            raise OncelyError("this entry replayed: it holds no claim")
        return self._acquired.token

    def complete(self, value: Any = None) -> None:
        """Set the outcome written when the block ends (``None`` if never called)."""
        if self._acquired is None:
            raise OncelyError("this entry replayed: there is nothing to complete")
        self._value = value

    def _unprotected(self) -> bool:
        """Under ``ONCELY_DISABLED`` (or `oncely.testing.disabled`): the block runs, nothing
        is read or written, and a warning says so."""
        if not _switches.disabled:
            return False
        _switches.warn_unprotected(self._plan.key, key=self._plan.key)
        self._acquired = _UNPROTECTED
        return True

    def _reentered(self) -> None:
        """Raise `InProgressError` if this key's block is running in this context already."""
        if self._mark in _OPEN.get():
            raise InProgressError(self._plan.key, retry_after=_inbox_flow.BUSY_HINT)

    def _entered(self, outcome: Acquired | Replay) -> None:
        if isinstance(outcome, Replay):
            self._replay = outcome
        else:
            self._acquired = outcome
            _OPEN.set(_OPEN.get() | {self._mark})
            self._open = True

    def _exit_flow(self, error: BaseException | None) -> Flow[None] | None:
        if self._open:
            _OPEN.set(_OPEN.get() - {self._mark})
            self._open = False
        if self._acquired is None or self._acquired is _UNPROTECTED:
            # replayed (nothing was written, the savepoint is gone), or disabled
            return _inbox_flow.end(error) if self._own else None
        return _inbox_flow.exit_flow(
            self._inbox, self._plan, self._acquired.token, self._value, error, self._own
        )

    def _enter_flow(self) -> Flow[Any] | None:
        """The claim's flow, or ``None`` (disabled, the block run unprotected; with a
        transaction to own, a flow that opens it)."""
        if self._unprotected():
            return _inbox_flow.open_flow() if self._own else None
        self._reentered()
        flow = _inbox_flow.enter(self._inbox, self._plan, self._own)
        if _events.on:
            flow = _observed.entering(self, flow, "inbox", self._plan.key, self._inbox.store)
        return flow


# -- drivers ------------------------------------------------------------------------------------


def _sleeping(perform: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """*perform* (a backend's), which also sleeps between attempts as the flow asks."""

    def run(op: Any) -> Any:
        if type(op) is _execution.Sleep:
            return time.sleep(op.seconds)
        return perform(op)

    return run


async def _asleep(perform: Callable[[Any], Awaitable[Any]], op: Any) -> Any:
    if type(op) is _execution.Sleep:
        return await asyncio.sleep(op.seconds)
    return await perform(op)


def _raw_connection(connection: Any) -> Any:
    return _txn.raw_connection(connection, _USER)


_araw_connection = _txn.araw_connection
