"""Races: threads, tasks and processes claim one key at once; exactly one is Acquired."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from oncely._core.protocols import Store
from oncely._core.records import Acquired, ClaimResult, InProgress
from oncely.testing._base import SuiteBase
from oncely.testing._calls import claim_in_process


class RaceChecks(SuiteBase):
    """Claims racing in threads, asyncio tasks and processes."""

    # -- races ---------------------------------------------------------------------------------

    def test_claim_race_threads_exactly_one_acquires(self, store: Store, key: str) -> None:
        """64 threads claim one key at once: exactly one is Acquired, the rest InProgress."""
        barrier = threading.Barrier(self.racers)

        def claim() -> ClaimResult:
            barrier.wait(timeout=60)
            return store.claim(key, "fp", lease=timedelta(minutes=1), ttl=self.ttl)

        with ThreadPoolExecutor(max_workers=self.racers) as pool:
            answers = list(pool.map(lambda _: claim(), range(self.racers)))
        acquired = [answer for answer in answers if isinstance(answer, Acquired)]
        assert len(acquired) == 1
        assert all(isinstance(a, (Acquired, InProgress)) for a in answers)

    def test_claim_race_async_tasks_exactly_one_acquires(self, store: Store, key: str) -> None:
        """64 asyncio tasks claim one key at once: exactly one is Acquired."""

        async def race() -> list[ClaimResult]:
            return await asyncio.gather(
                *(
                    store.aclaim(key, "fp", lease=timedelta(minutes=1), ttl=self.ttl)
                    for _ in range(self.racers)
                )
            )

        answers = asyncio.run(race())
        assert sum(isinstance(answer, Acquired) for answer in answers) == 1

    def test_claim_race_processes_exactly_one_acquires(self, namespace: str, key: str) -> None:
        """64 processes claim one key at once: exactly one is Acquired."""
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["oncely", "oncely.testing._calls", *self.preload])
        barrier = context.Barrier(self.racers)
        results = context.Queue()
        racers = [
            context.Process(
                target=claim_in_process,
                args=(self.store_url(), namespace, key, barrier, results),
            )
            for _ in range(self.racers)
        ]
        for racer in racers:
            racer.start()
        try:
            answers = [results.get(timeout=120) for _ in racers]
        finally:
            for racer in racers:
                racer.join(timeout=30)
            results.close()
            results.join_thread()
        assert answers.count("Acquired") == 1, answers
        assert set(answers) == {"Acquired", "InProgress"}, answers
        assert all(racer.exitcode == 0 for racer in racers)
