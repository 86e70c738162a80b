"""Broker drivers are optional: missing ones fail with the extra to install, nothing else."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK = "import sys\nfor name in {blocked!r}: sys.modules[name] = None\n"


def run(code: str, *, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    source = BLOCK.format(blocked=blocked) + code
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True)


def test_consumers_package_imports_no_driver() -> None:
    """`import oncely.consumers` (and the producer helpers) load no broker client."""
    out = run(
        "import oncely.consumers, oncely.consumers.producer\n"
        "drivers = ('aio_pika', 'aiokafka', 'confluent_kafka', 'nats', 'faststream', 'celery',"
        " 'redis')\n"
        "print([m for m in drivers if m in sys.modules])"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("module", "driver", "extra"),
    [
        ("oncely.consumers.rabbitmq", "aio_pika", "rabbitmq"),
        ("oncely.consumers.nats", "nats", "nats"),
        ("oncely.consumers.redis_streams", "redis", "redis"),
        ("oncely.consumers.faststream", "faststream", "faststream"),
        ("oncely.consumers.celery", "celery", "celery"),
    ],
)
def test_missing_driver_names_the_extra(module: str, driver: str, extra: str) -> None:
    """Importing an adapter without its driver raises MissingDependencyError naming the extra."""
    out = run(
        f"from oncely.errors import MissingDependencyError\n"
        f"try:\n    import {module}\n"
        f"except MissingDependencyError as exc:\n    print(exc)\n",
        blocked=(driver,),
    )
    assert out.returncode == 0, out.stderr
    assert f"pip install 'oncely[{extra}]'" in out.stdout


@pytest.mark.parametrize("driver", ["confluent_kafka", "aiokafka"])
def test_kafka_clients_are_required_when_used(driver: str) -> None:
    """The Kafka module serves two clients: each is required by the class that uses it."""
    cls = (
        "IdempotentKafkaConsumer" if driver == "confluent_kafka" else "AsyncIdempotentKafkaConsumer"
    )
    out = run(
        "import oncely\n"
        "from oncely.errors import MissingDependencyError\n"
        f"from oncely.consumers.kafka import {cls}\n"
        "try:\n"
        f"    {cls}({{'group.id': 'g'}}, ['t'], print, store=oncely.open_store('memory://'),"
        " producer=None)\n"
        "except MissingDependencyError as exc:\n    print(exc)\n",
        blocked=(driver,),
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'oncely[kafka]'" in out.stdout
