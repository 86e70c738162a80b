"""The CI fault campaign: a few hundred randomized histories, every store, every fault; no anomaly.

Every applicable store x entry point x fault combination runs once (see
`tests.faults._campaign.plans`); the seed is fixed so a failure replays, and
``ONCELY_FAULTS_SEED`` picks another. The larger campaign is ``benchmarks/faults/run.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import service_url
from tests.faults import _campaign

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.redis_cluster,
    pytest.mark.kafka,
    pytest.mark.rabbitmq,
    pytest.mark.nats,
    pytest.mark.slow,
]

HISTORIES = len(_campaign.combinations())


def test_the_campaign_finds_no_anomaly() -> None:
    seed = int(os.environ.get("ONCELY_FAULTS_SEED", "1"))
    plans = _campaign.plans(seed, HISTORIES)
    report = _campaign.run(
        plans,
        postgres=service_url("ONCELY_TEST_POSTGRES_URL"),
        redis_cluster=service_url("ONCELY_TEST_REDIS_CLUSTER_URL"),
        kafka=service_url("ONCELY_TEST_KAFKA_BOOTSTRAP"),
        rabbitmq=service_url("ONCELY_TEST_RABBITMQ_URL"),
        nats=service_url("ONCELY_TEST_NATS_URL"),
        parallel=6,
    )
    faults = report.faults()
    print(f"\nseed {seed}: {len(report.results)} histories in {report.seconds:.0f} s")
    print(report.table())
    print("faults injected:", dict(sorted(faults.items())))
    covered = {(r.plan.store, r.plan.entry, r.plan.fault) for r in report.results}
    assert len(covered) == len(report.results), "a combination ran twice before all ran once"
    expected = set(_campaign.FAULTS) - {"none", "zombie@ttl=lease"}
    assert expected <= set(faults), f"faults never injected: {expected - set(faults)}"
    assert not report.anomalies, "\n".join(report.lines())
