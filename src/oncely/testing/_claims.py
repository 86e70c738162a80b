"""Claims, settles, fencing tokens, payloads and namespaces: the rows of the state machine."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest

from oncely._core.clock import FrozenClock
from oncely._core.protocols import Store
from oncely._core.records import Acquired, InProgress, LeaseLost, Mismatch, Replay, Status
from oncely.testing._base import SuiteBase
from oncely.testing._calls import StoreCalls


class ClaimChecks(SuiteBase):
    """claim and the settles (complete, fail, release, extend), row by row."""

    # -- namespaces map (namespace, key) to records injectively ------------------------------

    def test_namespaces_and_keys_never_share_a_record(
        self, clock: FrozenClock | None, namespace: str
    ) -> None:
        """Pairs whose plain ``namespace:key`` would be the same text are separate records:
        each is Acquired, completes with its own result and replays it under its own key; a
        named namespace's `scan` (where the store has one) lists its own record only."""
        pairs = [
            (namespace, "eu:x"),
            (f"{namespace}:eu", "x"),
            (f"{namespace}%3Aeu", "x"),
            (f"{namespace}|eu", "x"),
            ("", f"{namespace}:eu:x"),
            ("", f"|{namespace}:eu:x"),
            ("", f"{namespace}|eu:x"),
        ]
        stores = [self.open_store(clock, space) for space, _ in pairs]
        try:
            for store, (space, key) in zip(stores, pairs, strict=True):
                answer = store.claim(key, "fp", lease=self.lease, ttl=self.ttl)
                assert answer == Acquired(1, recovered=False, attempt=1), (space, key, answer)
            for index, (store, (_, key)) in enumerate(zip(stores, pairs, strict=True)):
                assert store.complete(key, 1, b"%d" % index, ttl=self.ttl) is None
            for index, (store, (space, key)) in enumerate(zip(stores, pairs, strict=True)):
                replay = store.claim(key, "fp", lease=self.lease, ttl=self.ttl)
                assert isinstance(replay, Replay), (space, key, replay)
                assert (replay.record.key, replay.record.result) == (key, b"%d" % index)
                scan = getattr(store, "scan", None)
                if space and scan is not None:
                    assert [record.key for record in scan(limit=10)] == [key], space
        finally:
            for store in stores:
                store.close()

    # -- claim ---------------------------------------------------------------------------------

    def test_claim_absent_key_is_acquired_with_token_1(self, api: StoreCalls, key: str) -> None:
        """claim on an absent key: in_progress, token 1, Acquired."""
        answer = self._acquire(api, key)
        assert answer == Acquired(1, recovered=False, attempt=1)
        record = api.get(key)
        assert record is not None
        assert (record.status, record.token, record.fingerprint) == (Status.IN_PROGRESS, 1, "fp")

    def test_claim_live_lease_same_fingerprint_is_in_progress(
        self, api: StoreCalls, key: str
    ) -> None:
        """claim while the lease is live: InProgress with the lease's remaining time."""
        assert isinstance(api.claim(key, "fp", lease=self.live_lease, ttl=self.ttl), Acquired)
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, InProgress)
        assert timedelta(0) < answer.retry_after <= self.live_lease

    def test_claim_expired_lease_same_fingerprint_is_recovered(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """claim after the lease expired: token + 1, attempt + 1, Acquired(recovered=True)."""
        self._acquire(api, key)
        wait(self.short_lease + timedelta(milliseconds=50))
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert answer == Acquired(2, recovered=True, attempt=2)

    def test_claim_completed_same_fingerprint_replays(self, api: StoreCalls, key: str) -> None:
        """claim on a completed record: Replay of the record, result byte for byte."""
        token = self._acquire(api, key).token
        assert api.complete(key, token, b"\x00result\xff", ttl=self.ttl) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert answer.record.status is Status.COMPLETED
        assert answer.record.result == b"\x00result\xff"
        assert answer.record.key == key

    def test_claim_failed_same_fingerprint_replays(self, api: StoreCalls, key: str) -> None:
        """claim on a failed record: Replay of the stored error."""
        token = self._acquire(api, key).token
        assert api.fail(key, token, b"declined", ttl=self.ttl) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert (answer.record.status, answer.record.result) == (Status.FAILED, b"declined")

    @pytest.mark.parametrize("state", ["in_progress", "completed", "failed"])
    def test_claim_live_record_other_fingerprint_is_mismatch(
        self, api: StoreCalls, key: str, state: str
    ) -> None:
        """claim with another fingerprint on any live record: Mismatch, nothing changes."""
        token = self._acquire(api, key, "fp-1").token
        if state == "completed":
            api.complete(key, token, b"r", ttl=self.ttl)
        elif state == "failed":
            api.fail(key, token, b"e", ttl=self.ttl)
        before = api.get(key)
        answer = api.claim(key, "fp-2", lease=self.short_lease, ttl=self.ttl)
        assert answer == Mismatch(stored_fingerprint="fp-1")
        after = api.get(key)
        assert before is not None
        assert after is not None
        assert (after.status, after.token, after.fingerprint) == (
            before.status,
            before.token,
            before.fingerprint,
        )

    def test_claim_after_record_expiry_is_acquired_afresh(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """claim on a record past its expiry: Acquired, not recovered, any fingerprint."""
        token = self._acquire(api, key).token
        short_ttl = self.short_lease * 2
        api.complete(key, token, b"old", ttl=short_ttl)
        wait(short_ttl + timedelta(milliseconds=50))
        assert api.get(key) is None
        answer = api.claim(key, "other-fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Acquired)
        assert not answer.recovered
        assert answer.attempt == 1

    def test_claim_after_release_is_acquired_with_next_token(
        self, api: StoreCalls, key: str
    ) -> None:
        """A released key behaves as absent for claim but keeps its token."""
        token = self._acquire(api, key).token
        assert api.release(key, token) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert answer == Acquired(token + 1, recovered=False, attempt=2)

    def test_claim_after_release_accepts_another_fingerprint(
        self, api: StoreCalls, key: str
    ) -> None:
        """A released tombstone does not hold the old fingerprint against a new request."""
        token = self._acquire(api, key, "fp-1").token
        api.release(key, token)
        answer = api.claim(key, "fp-2", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Acquired)
        assert answer.token == token + 1

    # -- settle --------------------------------------------------------------------------------

    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_with_wrong_token_is_lease_lost(
        self, api: StoreCalls, key: str, verb: str
    ) -> None:
        """complete / fail / release / extend with a token that does not hold the lease."""
        token = self._acquire(api, key).token
        assert self._settle(api, verb, key, token + 1) == LeaseLost()
        record = api.get(key)
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, token)

    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_absent_key_is_lease_lost(self, api: StoreCalls, key: str, verb: str) -> None:
        """complete / fail / release / extend on an absent key: LeaseLost, nothing created."""
        assert self._settle(api, verb, key, 1) == LeaseLost()
        assert api.get(key) is None

    @pytest.mark.parametrize("first", ["complete", "fail", "release"])
    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_after_settled_is_lease_lost(
        self, api: StoreCalls, key: str, first: str, verb: str
    ) -> None:
        """A lease settles once: any verb after complete, fail or release is LeaseLost."""
        token = self._acquire(api, key).token
        assert self._settle(api, first, key, token) is None
        before = api.get(key)
        assert self._settle(api, verb, key, token) == LeaseLost()
        after = api.get(key)
        assert before is not None
        assert after is not None
        assert (after.status, after.result) == (before.status, before.result)

    @pytest.mark.parametrize("verb", ["complete", "fail", "release", "extend"])
    def test_settle_after_takeover_is_lease_lost(
        self, api: StoreCalls, key: str, verb: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A zombie whose lease was taken over cannot settle the new owner's record."""
        old = self._acquire(api, key).token
        wait(self.short_lease + timedelta(milliseconds=50))
        new = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(new, Acquired)
        assert new.recovered
        assert self._settle(api, verb, key, old) == LeaseLost()
        assert api.complete(key, new.token, b"mine", ttl=self.ttl) is None
        replay = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(replay, Replay)
        assert replay.record.result == b"mine"

    def test_complete_after_lease_expiry_without_takeover_succeeds(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """A slow worker whose lease expired but was not taken over still holds the token."""
        token = self._acquire(api, key).token
        wait(self.short_lease + timedelta(milliseconds=50))
        assert api.complete(key, token, b"late", ttl=self.ttl) is None

    def test_extend_moves_the_lease_forward(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """extend: a claim after the original lease's end still finds the lease live."""
        token = self._acquire(api, key).token
        wait(self.short_lease * 0.6)
        assert api.extend(key, token, lease=self.live_lease) is None
        wait(self.short_lease * 0.6)
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, InProgress)

    def test_extend_on_expired_lease_before_takeover_succeeds(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """extend after expiry, with no takeover yet, renews the lease for the same token."""
        token = self._acquire(api, key).token
        wait(self.short_lease + timedelta(milliseconds=50))
        assert api.extend(key, token, lease=self.live_lease) is None
        assert isinstance(api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl), InProgress)

    # -- fencing -------------------------------------------------------------------------------

    def test_tokens_only_grow(
        self, api: StoreCalls, key: str, wait: Callable[[timedelta], None]
    ) -> None:
        """Tokens grow across release, takeover and completion-then-expiry of the lease."""
        tokens = [self._acquire(api, key).token]
        api.release(key, tokens[-1])
        tokens.append(self._acquire(api, key).token)
        wait(self.short_lease + timedelta(milliseconds=50))
        taken = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(taken, Acquired)
        tokens.append(taken.token)
        api.release(key, tokens[-1])
        tokens.append(self._acquire(api, key).token)
        assert tokens == sorted(set(tokens)), tokens
        assert tokens == [1, 2, 3, 4]

    # -- payloads ------------------------------------------------------------------------------

    def test_multi_mib_binary_result_round_trips(self, api: StoreCalls, key: str) -> None:
        """A 5 MiB result with every byte value replays byte for byte."""
        payload = os.urandom(5 * 1024 * 1024) + bytes(range(256)) + b"\x00" * 1024
        token = self._acquire(api, key).token
        assert api.complete(key, token, payload, ttl=self.ttl) is None
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert answer.record.result == payload

    def test_empty_result_is_not_none(self, api: StoreCalls, key: str) -> None:
        """An empty result is stored as empty bytes, distinct from no result."""
        token = self._acquire(api, key).token
        api.complete(key, token, b"", ttl=self.ttl)
        answer = api.claim(key, "fp", lease=self.short_lease, ttl=self.ttl)
        assert isinstance(answer, Replay)
        assert answer.record.result == b""

    def test_keys_are_binary_safe_text(self, api: StoreCalls) -> None:
        """Keys with separators, quotes, braces and unicode do not collide or break the store."""
        keys = [f"{uuid.uuid4().hex}{suffix}" for suffix in ("|a", "{b}", "'c\"", "d:e", "é ü")]
        for key in keys:
            self._acquire(api, key)
        for key in keys:
            record = api.get(key)
            assert record is not None
            assert record.key == key

    def test_namespaces_are_isolated(self, store: Store, clock: FrozenClock | None) -> None:
        """Two stores with different namespaces over the same backend never see each other."""
        other = self.open_store(clock, f"other{uuid.uuid4().hex[:8]}")
        try:
            assert isinstance(
                store.claim("shared", "fp", lease=self.short_lease, ttl=self.ttl), Acquired
            )
            assert isinstance(
                other.claim("shared", "fp", lease=self.short_lease, ttl=self.ttl), Acquired
            )
        finally:
            other.close()
