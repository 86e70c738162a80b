"""Hypothesis drives a store and the reference state machine side by side."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from oncely._core import machine
from oncely._core.clock import FrozenClock
from oncely._core.records import Acquired, ClaimResult, InProgress, Record, Replay, Status
from oncely.testing._base import SuiteBase
from oncely.testing._calls import StoreCalls


class ModelChecks(SuiteBase):
    """The store agrees with `oncely._core.machine` on random sequences of verbs."""

    def test_store_agrees_with_reference_machine(
        self, api: StoreCalls, clock: FrozenClock | None
    ) -> None:
        """Hypothesis drives the store and the pure state machine side by side: they agree."""
        run_state_machine_as_test(
            _model_machine(api, clock, self.lease),
            settings=settings(
                max_examples=25,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )


def _model_machine(
    api: StoreCalls, clock: FrozenClock | None, lease: timedelta
) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one store; the reference machine is its oracle."""
    lease_ms = lease // timedelta(milliseconds=1)
    ttl_ms = lease_ms * 4
    # Without a controllable clock, time never matters: leases outlive the test.
    now = clock.now_ms if clock is not None else (lambda: 0)

    class StoreVersusModel(RuleBasedStateMachine):
        tokens = Bundle("tokens")

        def __init__(self) -> None:
            super().__init__()
            self.prefix = uuid.uuid4().hex[:10]
            self.model: dict[str, Record] = {}

        def _key(self, index: int) -> str:
            return f"{self.prefix}-{index}"

        def _apply(self, key: str, new: Record | None) -> None:
            if new is not None:
                self.model[key] = new

        @rule(target=tokens, index=st.integers(0, 2), fp=st.sampled_from(["a", "b"]))
        def claim(self, index: int, fp: str) -> int:
            key = self._key(index)
            found = self.model.get(key)
            new, expected = machine.claim(
                key, found, fp, now_ms=now(), lease_ms=lease_ms, ttl_ms=ttl_ms
            )
            actual: ClaimResult = api.claim(
                key,
                fp,
                lease=timedelta(milliseconds=lease_ms),
                ttl=timedelta(milliseconds=ttl_ms),
            )
            assert type(actual) is type(expected), (actual, expected)
            if (
                isinstance(expected, Acquired)
                and isinstance(actual, Acquired)
                and found is not None
                and not found.is_live(now())
                and actual.token == 1
                and new is not None
            ):
                # Past its expiry a record may be gone from the store (Redis TTL, a purge) or
                # still there: tokens restart at 1 or go on. Both are within the contract.
                new = replace(new, token=1)
                expected = replace(expected, token=1)
            self._apply(key, new)
            if isinstance(expected, Replay):
                assert isinstance(actual, Replay)
                got = actual.record
                assert (got.status, got.token, got.result, got.fingerprint) == (
                    expected.record.status,
                    expected.record.token,
                    expected.record.result,
                    expected.record.fingerprint,
                )
            elif isinstance(expected, InProgress):
                if clock is not None:
                    assert actual == expected
            else:
                assert actual == expected
            return expected.token if isinstance(expected, Acquired) else 0

        @rule(
            index=st.integers(0, 2),
            token=st.one_of(tokens, st.integers(0, 9)),
            verb=st.sampled_from(["complete", "fail", "release", "extend"]),
            payload=st.binary(max_size=16),
        )
        def settle(self, index: int, token: int, verb: str, payload: bytes) -> None:
            key = self._key(index)
            record = self.model.get(key)
            if verb == "complete":
                new, expected = machine.complete(
                    record, token, payload, now_ms=now(), ttl_ms=ttl_ms
                )
                actual = api.complete(key, token, payload, ttl=timedelta(milliseconds=ttl_ms))
            elif verb == "fail":
                new, expected = machine.fail(record, token, payload, now_ms=now(), ttl_ms=ttl_ms)
                actual = api.fail(key, token, payload, ttl=timedelta(milliseconds=ttl_ms))
            elif verb == "release":
                new, expected = machine.release(record, token, now_ms=now())
                actual = api.release(key, token)
            else:
                new, expected = machine.extend(record, token, now_ms=now(), lease_ms=lease_ms)
                actual = api.extend(key, token, lease=timedelta(milliseconds=lease_ms))
            self._apply(key, new)
            assert actual == expected, (verb, actual, expected)

        if clock is not None:

            @rule(ms=st.integers(0, lease_ms * 2))
            def advance(self, ms: int) -> None:
                assert clock is not None
                clock.advance(ms)

        @invariant()
        def records_agree(self) -> None:
            for index in range(3):
                key = self._key(index)
                expected = self.model.get(key)
                if expected is not None and not expected.is_live(now()):
                    expected = None
                actual = api.get(key)
                if expected is None or expected.status is Status.RELEASED:
                    assert actual is None or actual.status is Status.RELEASED
                else:
                    assert actual is not None
                    assert (actual.status, actual.token, actual.attempt, actual.result) == (
                        expected.status,
                        expected.token,
                        expected.attempt,
                        expected.result,
                    )

    return StoreVersusModel
