"""An in-progress record outlives its lease, and a settle that landed is known by its record."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from oncely._core import machine
from oncely._core.records import Acquired, LeaseLost, Replay
from oncely.testing._base import SuiteBase
from oncely.testing._calls import StoreCalls


class LeaseChecks(SuiteBase):
    """Tokens never repeat while a worker holding an older one may be alive."""

    # -- an in-progress record outlives its lease -----------------------------------------------
    # Tokens never repeat while a worker holding an older one may be alive: whatever the ttl,
    # an in-progress record stays at least max(ttl, lease) past the end of its lease (claim,
    # takeover, extend), so a claim after the lease lapsed takes over with the next token and
    # the zombie's complete is LeaseLost, instead of the key vanishing and restarting at 1.

    @property
    def _fence_lease(self) -> timedelta:
        """The lease of the tests below: on a server clock, long enough that a claim made
        just after it lapsed lands well inside the record's margin on a loaded machine."""
        return self.lease if self.controls_clock else timedelta(seconds=1)

    def _past(self, lease: timedelta) -> timedelta:
        return lease + timedelta(milliseconds=100)

    def _take_over(self, api: StoreCalls, key: str, previous: int) -> Acquired:
        answer = api.claim(key, "fp", lease=self._fence_lease, ttl=self._fence_lease)
        assert isinstance(answer, Acquired), answer
        assert answer.recovered, answer
        assert answer.token > previous, (answer, previous)
        return answer

    def _assert_zombie_is_fenced(self, api: StoreCalls, key: str, zombie: int, owner: int) -> None:
        assert api.complete(key, zombie, b"zombie", ttl=self.ttl) == LeaseLost()
        assert api.complete(key, owner, b"owner", ttl=self.ttl) is None
        replay = api.claim(key, "fp", lease=self._fence_lease, ttl=self.ttl)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"owner"

    @pytest.mark.parametrize("ttl_share", [1.0, 0.5], ids=["ttl_equals_lease", "ttl_below_lease"])
    def test_record_outlives_its_lease_when_ttl_is_not_longer(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None], ttl_share: float
    ) -> None:
        """ttl <= lease: after the lease lapses the next claimer gets a greater token, and the
        zombie holding the old one cannot complete its record."""
        lease = self._fence_lease
        first = api.claim(key, "fp", lease=lease, ttl=lease * ttl_share)
        assert isinstance(first, Acquired)
        wait(self._past(lease))
        second = self._take_over(api, key, first.token)
        self._assert_zombie_is_fenced(api, key, first.token, second.token)

    def test_record_outlives_a_lease_extended_past_the_ttl(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A heartbeat carries the lease past the ttl: the record outlives the extended lease."""
        lease = self._fence_lease
        first = api.claim(key, "fp", lease=lease, ttl=lease)
        assert isinstance(first, Acquired)
        assert api.extend(key, first.token, lease=lease * 1.5) is None
        wait(self._past(lease * 1.5))
        second = self._take_over(api, key, first.token)
        self._assert_zombie_is_fenced(api, key, first.token, second.token)

    def test_record_outlives_a_recovered_lease(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A takeover's lease ends past the record's first expiry: the record outlives it too."""
        lease = self._fence_lease
        first = api.claim(key, "fp", lease=lease, ttl=lease)
        assert isinstance(first, Acquired)
        wait(self._past(lease))
        second = self._take_over(api, key, first.token)
        wait(self._past(lease))
        third = self._take_over(api, key, second.token)
        assert api.complete(key, first.token, b"zombie", ttl=self.ttl) == LeaseLost()
        self._assert_zombie_is_fenced(api, key, second.token, third.token)

    @pytest.mark.parametrize("ttl_share", [0.5, 1.0, 4.0])
    def test_in_progress_record_expires_a_margin_past_its_lease(
        self, api: StoreCalls, key: str, ttl_share: float
    ) -> None:
        """The record's expiry is at least max(ttl, lease) past its lease's end, after a claim
        and after an extend (which keeps that margin past the new end)."""
        lease = self._fence_lease
        ttl = lease * ttl_share
        margin = max(ttl, lease) // timedelta(milliseconds=1)
        first = api.claim(key, "fp", lease=lease, ttl=ttl)
        assert isinstance(first, Acquired)
        record = api.get(key)
        assert record is not None
        assert record.expires_at_ms - record.lease_expires_at_ms >= margin, record
        assert api.extend(key, first.token, lease=lease * 2) is None
        extended = api.get(key)
        assert extended is not None
        assert extended.lease_expires_at_ms > record.lease_expires_at_ms
        assert extended.expires_at_ms - extended.lease_expires_at_ms >= margin, extended

    def test_a_settle_that_landed_is_recognised_by_its_record(
        self, api: StoreCalls, key: str
    ) -> None:
        """The one rule for a settle whose reply was lost (`oncely._core.machine.landed`), held
        against what this store keeps: sent again, the settle answers LeaseLost, and the record
        shows it landed for its own token, verb and result, and for nothing else."""
        ttl = timedelta(minutes=5)
        for verb in ("complete", "fail", "release"):
            name = f"{key}-{verb}"
            first = api.claim(name, "fp", lease=timedelta(seconds=30), ttl=ttl)
            assert isinstance(first, Acquired)
            assert not machine.landed(api.get(name), first.token)
            if verb == "release":
                assert api.release(name, first.token) is None
                again = api.release(name, first.token)
            else:
                settle = getattr(api, verb)
                assert settle(name, first.token, b"outcome", ttl=ttl) is None
                again = settle(name, first.token, b"outcome", ttl=ttl)
            assert isinstance(again, LeaseLost)
            record = api.get(name)
            result = None if verb == "release" else b"outcome"
            assert machine.landed(record, first.token)
            assert machine.landed(record, first.token, verb, result)
            assert not machine.landed(record, first.token + 1, verb, result)
            if result is not None:
                assert not machine.landed(record, first.token, verb, b"another outcome")
            other = "release" if verb != "release" else "complete"
            assert not machine.landed(record, first.token, other)
