"""Publisher URLs: a scheme names the class that opens it, imported only when used."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Final

from oncely.errors import ConfigurationError, MissingDependencyError
from oncely.outbox._event import Publisher

__all__ = ["SCHEMES", "load_factory", "publisher_from_url"]

SCHEMES: Final[Mapping[str, str]] = {
    "amqp": "oncely.outbox.rabbitmq:RabbitMQPublisher",
    "amqps": "oncely.outbox.rabbitmq:RabbitMQPublisher",
    "kafka": "oncely.outbox.kafka:KafkaPublisher",
    "nats": "oncely.outbox.nats:NATSPublisher",
    "tls": "oncely.outbox.nats:NATSPublisher",
    "redis": "oncely.outbox.redis_streams:RedisStreamsPublisher",
    "rediss": "oncely.outbox.redis_streams:RedisStreamsPublisher",
}
"""URL scheme → ``module:class`` whose ``from_url(url)`` builds the publisher (no connection)."""


def publisher_from_url(url: str) -> Publisher:
    """The publisher for a broker URL (``amqp://``, ``kafka://``, ``nats://``, ``redis://``…).

    Nothing connects until the first publish.

    Raises:
        ConfigurationError: No publisher is known for the URL's scheme, or the URL is bad.
        MissingDependencyError: The broker's client library is not installed.

    .. versionadded:: 0.1.0
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(f"a broker URL looks like kafka://host:9092, not {url!r}")
    scheme = url.partition("://")[0].lower()
    target = SCHEMES.get(scheme)
    if target is None:
        known = ", ".join(f"{name}://" for name in SCHEMES)
        raise ConfigurationError(f"no outbox publisher for {scheme}:// URLs (known: {known})")
    cls = load_factory(target)
    publisher: Publisher = getattr(cls, "from_url")(url)  # noqa: B009  # a loaded class
    return publisher


def load_factory(target: str) -> Any:
    """Import ``module:attribute`` (``attribute`` may be dotted) and return the attribute."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"a publisher factory is module:attribute, not {target!r}")
    try:
        found: Any = importlib.import_module(module_name)
    except MissingDependencyError:
        raise
    except ImportError as exc:
        missing = getattr(exc, "name", None) or module_name
        if module_name.startswith("oncely.") and missing.startswith("oncely"):
            raise MissingDependencyError(
                f"the publisher module {module_name!r} is not available in this oncely"
            ) from exc
        raise MissingDependencyError(
            f"cannot import {module_name!r} for the publisher ({exc}); install what it needs"
        ) from exc
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ConfigurationError(f"{module_name!r} has no attribute {attribute!r}") from None
    return found
