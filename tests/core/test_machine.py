"""One test per row of the state machine (docs/contract.md), against the pure reference
machine."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from oncely._core import machine
from oncely._core.records import Acquired, InProgress, LeaseLost, Mismatch, Record, Replay, Status

LEASE = 1_000
TTL = 60_000


def claimed(now: int = 0, fp: str = "fp") -> Record:
    record, answer = machine.claim("k", None, fp, now_ms=now, lease_ms=LEASE, ttl_ms=TTL)
    assert isinstance(answer, Acquired)
    assert record is not None
    return record


class TestClaim:
    def test_absent_is_acquired_with_token_1(self) -> None:
        """absent → in_progress, token 1."""
        record, answer = machine.claim("k", None, "fp", now_ms=5, lease_ms=LEASE, ttl_ms=TTL)
        assert answer == Acquired(1, recovered=False, attempt=1)
        assert record is not None
        assert record.status is Status.IN_PROGRESS
        assert record.lease_expires_at_ms == 5 + LEASE
        assert record.expires_at_ms == 5 + LEASE + max(TTL, LEASE)  # a margin past the lease

    def test_in_progress_record_outlives_its_lease(self) -> None:
        """An in-progress record is kept for the ttl, not the lease, so its token survives."""
        record = claimed()
        assert record.expires_at_ms > record.lease_expires_at_ms

    def test_live_lease_same_fp_is_in_progress(self) -> None:
        """in_progress, lease live, same fp → InProgress(retry_after = lease remaining)."""
        new, answer = machine.claim("k", claimed(), "fp", now_ms=400, lease_ms=LEASE, ttl_ms=TTL)
        assert new is None
        assert answer == InProgress(retry_after=timedelta(milliseconds=600))

    def test_expired_lease_same_fp_is_recovered(self) -> None:
        """in_progress, lease expired, same fp → token + 1, attempt + 1, recovered."""
        new, answer = machine.claim("k", claimed(), "fp", now_ms=LEASE, lease_ms=LEASE, ttl_ms=TTL)
        assert answer == Acquired(2, recovered=True, attempt=2)
        assert new is not None
        assert new.lease_expires_at_ms == 2 * LEASE

    def test_completed_same_fp_replays(self) -> None:
        """completed, same fp → Replay(record)."""
        done, _ = machine.complete(claimed(), 1, b"r", now_ms=10, ttl_ms=TTL)
        new, answer = machine.claim("k", done, "fp", now_ms=20, lease_ms=LEASE, ttl_ms=TTL)
        assert new is None
        assert answer == Replay(done)  # type: ignore[arg-type]

    def test_failed_same_fp_replays(self) -> None:
        """failed, same fp → Replay(record)."""
        failed, _ = machine.fail(claimed(), 1, b"e", now_ms=10, ttl_ms=TTL)
        _, answer = machine.claim("k", failed, "fp", now_ms=20, lease_ms=LEASE, ttl_ms=TTL)
        assert isinstance(answer, Replay)
        assert answer.record.status is Status.FAILED

    def test_any_live_record_other_fp_is_mismatch(self) -> None:
        """any live record, different fp → Mismatch, no change."""
        for record in (claimed(), machine.complete(claimed(), 1, b"", now_ms=1, ttl_ms=TTL)[0]):
            new, answer = machine.claim("k", record, "x", now_ms=2, lease_ms=LEASE, ttl_ms=TTL)
            assert (new, answer) == (None, Mismatch(stored_fingerprint="fp"))

    def test_record_past_expiry_is_acquired_with_next_token(self) -> None:
        """any record past its expiry → Acquired(token + 1), attempt starts again."""
        done, _ = machine.complete(claimed(), 1, b"r", now_ms=0, ttl_ms=100)
        assert done is not None
        _new, answer = machine.claim("k", done, "other", now_ms=100, lease_ms=LEASE, ttl_ms=TTL)
        assert answer == Acquired(2, recovered=False, attempt=1)

    def test_released_behaves_as_absent_but_keeps_token(self) -> None:
        """released → claim is Acquired with the next token; the attempt count goes on."""
        released, _ = machine.release(claimed(), 1, now_ms=10)
        assert released is not None
        assert released.status is Status.RELEASED
        _, answer = machine.claim("k", released, "fp2", now_ms=11, lease_ms=LEASE, ttl_ms=TTL)
        assert answer == Acquired(2, recovered=False, attempt=2)


class TestSettle:
    def test_complete_with_token(self) -> None:
        """complete with the holding token → completed, kept for ttl."""
        new, answer = machine.complete(claimed(), 1, b"r", now_ms=10, ttl_ms=500)
        assert answer is None
        assert new is not None
        assert (new.status, new.result, new.expires_at_ms) == (Status.COMPLETED, b"r", 510)

    def test_fail_with_token(self) -> None:
        """fail with the holding token → failed."""
        new, answer = machine.fail(claimed(), 1, b"e", now_ms=10, ttl_ms=500)
        assert answer is None
        assert new is not None
        assert new.status is Status.FAILED

    def test_extend_moves_lease(self) -> None:
        """extend with the holding token → lease moved forward."""
        new, answer = machine.extend(claimed(), 1, now_ms=900, lease_ms=LEASE)
        assert answer is None
        assert new is not None
        assert new.lease_expires_at_ms == 1900

    def test_extend_beyond_ttl_keeps_record_alive(self) -> None:
        """A lease extended past the record's expiry extends the record too."""
        record = claimed()
        new, _ = machine.extend(record, 1, now_ms=TTL - 1, lease_ms=LEASE)
        assert new is not None
        assert new.expires_at_ms >= new.lease_expires_at_ms

    def test_anything_else_is_lease_lost(self) -> None:
        """complete / fail / release / extend on anything else → LeaseLost, no change."""
        done, _ = machine.complete(claimed(), 1, b"r", now_ms=1, ttl_ms=TTL)
        expired = claimed()
        cases = [(None, 1), (claimed(), 2), (done, 1), (expired, 1)]
        for record, token in cases:
            now = LEASE + TTL if record is expired else 5  # claimed() at 0 expires then
            for result in (
                machine.complete(record, token, b"", now_ms=now, ttl_ms=TTL),
                machine.fail(record, token, b"", now_ms=now, ttl_ms=TTL),
                machine.release(record, token, now_ms=now),
                machine.extend(record, token, now_ms=now, lease_ms=LEASE),
            ):
                assert result == (None, LeaseLost())


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["claim", "complete", "release", "extend", "fail"]),
            st.integers(0, 3_000),
            st.integers(1, 6),
        ),
        max_size=40,
    )
)
def test_tokens_only_grow_and_one_lease_at_a_time(steps: list[tuple[str, int, int]]) -> None:
    """Property: tokens never decrease, and no two Acquired answers overlap a live lease."""
    record: Record | None = None
    now = 0
    last_token = 0
    live_until = -1
    for verb, delay, token in steps:
        now += delay
        if verb == "claim":
            new, answer = machine.claim("k", record, "fp", now_ms=now, lease_ms=LEASE, ttl_ms=TTL)
            if isinstance(answer, Acquired):
                assert answer.token > last_token
                assert now >= live_until or (record is not None and record.status != "in_progress")
                last_token = answer.token
                live_until = now + LEASE
        elif verb == "complete":
            new, _ = machine.complete(record, token, b"", now_ms=now, ttl_ms=TTL)
        elif verb == "fail":
            new, _ = machine.fail(record, token, b"", now_ms=now, ttl_ms=TTL)
        elif verb == "release":
            new, _ = machine.release(record, token, now_ms=now)
        else:
            new, _ = machine.extend(record, token, now_ms=now, lease_ms=LEASE)
            if new is not None:
                live_until = new.lease_expires_at_ms
        if new is not None:
            assert new.token >= (record.token if record else 0)
            record = new
        if record is not None and record.status is not Status.IN_PROGRESS:
            live_until = -1


def test_landed_is_the_one_rule_for_a_settle_whose_reply_was_lost() -> None:
    """A record shows a settle landed for the token that holds it, the status its verb sets
    and, when given, the very result; nothing else counts."""
    from oncely._core.machine import SETTLED, landed

    base = Record(
        key="k",
        status=Status.IN_PROGRESS,
        fingerprint="fp",
        token=3,
        attempt=1,
        lease_expires_at_ms=2_000,
        expires_at_ms=9_000,
        created_at_ms=1_000,
        updated_at_ms=1_000,
    )
    assert not landed(None, 3)
    assert not landed(base, 3)
    assert not landed(base, 3, "complete")
    for verb, status in SETTLED.items():
        settled = replace(base, status=status, result=b"r" if verb != "release" else None)
        assert landed(settled, 3)
        assert landed(settled, 3, verb)
        assert not landed(settled, 4, verb)
        assert not landed(settled, 2)
        for other in set(SETTLED) - {verb}:
            assert not landed(settled, 3, other)
    completed = replace(base, status=Status.COMPLETED, result=b"r")
    assert landed(completed, 3, "complete", b"r")
    assert not landed(completed, 3, "complete", b"other")
