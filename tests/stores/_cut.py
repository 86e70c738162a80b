"""Lost replies: `tests._proxy.Proxy` lets one request through and cuts the connection before
its reply (`Proxy.arm`).

This is the lost reply: the server applied the command (a Lua script ran, a statement
committed), but the client only sees its connection die, and a driver or store that re-sends
the command must recognise the effect the first send had.
"""

from __future__ import annotations

import time
from datetime import timedelta

from oncely import Acquired, InProgress, LeaseLost, Status
from oncely.testing.conformance import StoreCalls
from tests._proxy import Proxy

VERBS = (
    "claim",
    "takeover",
    "complete",
    "fail",
    "release",
    "extend",
    "claim_many",
    "complete_many",
)
"""Every transition whose reply `assert_lost_reply_is_recognised` cuts."""


def assert_lost_reply_is_recognised(
    api: StoreCalls,
    cutter: Proxy,
    verb: str,
    key: str,
    *,
    until: bytes = b"",
    hold: bool = False,
) -> None:
    """Cut the reply to *verb* on *key* once: the caller gets the answer the reply carried.

    With *hold* the reply never comes and the connection stays open: the client times out.
    Then a new call of the same verb is answered as a second call (not recognised as a re-send),
    so recognising a re-send cannot hide a real duplicate.
    """
    lease, ttl = timedelta(seconds=30), timedelta(minutes=5)
    marker = key.encode()
    if verb == "claim":
        cutter.arm(marker, until=until, hold=hold)
        assert api.claim(key, "fp", lease=lease, ttl=ttl) == Acquired(1, recovered=False)
        assert isinstance(api.claim(key, "fp", lease=lease, ttl=ttl), InProgress)
    elif verb == "takeover":
        first = api.claim(key, "fp", lease=timedelta(milliseconds=300), ttl=ttl)
        assert isinstance(first, Acquired)
        time.sleep(0.4)
        cutter.arm(marker, until=until, hold=hold)
        answer = api.claim(key, "fp", lease=lease, ttl=ttl)
        assert answer == Acquired(2, recovered=True, attempt=2), answer
        assert isinstance(api.claim(key, "fp", lease=lease, ttl=ttl), InProgress)
    elif verb in ("complete", "fail"):
        token = api.claim(key, "fp", lease=lease, ttl=ttl).token
        cutter.arm(marker, until=until, hold=hold)
        settle = api.complete if verb == "complete" else api.fail
        assert settle(key, token, b"done", ttl=ttl) is None
        record = api.get(key)
        assert record is not None
        status = Status.COMPLETED if verb == "complete" else Status.FAILED
        assert (record.status, record.token, record.result) == (status, token, b"done")
        assert settle(key, token, b"done", ttl=ttl) == LeaseLost()
    elif verb == "release":
        token = api.claim(key, "fp", lease=lease, ttl=ttl).token
        cutter.arm(marker, until=until, hold=hold)
        assert api.release(key, token) is None
        assert api.release(key, token) == LeaseLost()
        assert api.claim(key, "fp", lease=lease, ttl=ttl) == Acquired(token + 1, attempt=2)
    elif verb == "extend":
        token = api.claim(key, "fp", lease=lease, ttl=ttl).token
        cutter.arm(marker, until=until, hold=hold)
        assert api.extend(key, token, lease=lease * 2) is None
        record = api.get(key)
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, token)
    elif verb == "claim_many":
        keys = [key, f"{key}-2"]
        cutter.arm(marker, until=until, hold=hold)
        answers = api.claim_many([(one, "fp") for one in keys], lease=lease, ttl=ttl)
        assert answers == [Acquired(1, recovered=False)] * 2, answers
        again = api.claim_many([(one, "fp") for one in keys], lease=lease, ttl=ttl)
        assert all(isinstance(answer, InProgress) for answer in again), again
    elif verb == "complete_many":
        keys = [key, f"{key}-2"]
        claimed = api.claim_many([(one, "fp") for one in keys], lease=lease, ttl=ttl)
        items = [(one, answer.token, b"done") for one, answer in zip(keys, claimed, strict=True)]
        cutter.arm(marker, until=until, hold=hold)
        assert api.complete_many(items, ttl=ttl) == [None, None]
        for one in keys:
            record = api.get(one)
            assert record is not None
            assert (record.status, record.result) == (Status.COMPLETED, b"done")
        assert api.complete_many(items, ttl=ttl) == [LeaseLost(), LeaseLost()]
    else:  # pragma: no cover - a typo in a test's parameters
        raise ValueError(verb)
    assert cutter.cuts >= 1, "the proxy never cut a reply: the test did not test anything"
