"""Key validation and scoping: the rules every entry point applies before a key touches a store."""

from __future__ import annotations

import hashlib
import sys
import uuid
from pathlib import Path

from oncely.errors import InvalidKeyError

__all__ = [
    "CONTENT_KEY_VERSION",
    "MAX_KEY_LENGTH",
    "code_scope",
    "content_key",
    "hashed_key",
    "name_key",
    "scope_key",
    "validate_key",
]

MAX_KEY_LENGTH = 255
"""The longest key a client may send (characters), as in Stripe's API."""

CONTENT_KEY_VERSION = "v2"
"""The version of the content key format, written into every key after its prefix.

Keys of the first format (``sha256:<hex>``) read numbers as binary floats where fields were
chosen and in the consumers' ``key="content"``, so payloads that differed only past a float's
17 digits shared a key. Version 2 keys are exact and never equal a first-format key.
"""


def name_key(key: object) -> object:
    """*key* as text when it is an int or a `uuid.UUID` (they name operations too; bools do
    not), else unchanged for `validate_key` to judge."""
    if type(key) is not str and isinstance(key, (int, uuid.UUID)) and type(key) is not bool:
        return str(key)
    return key


_HASH_IT = "; derive a valid key from it with oncely.keys.hashed(value)"


def validate_key(key: object) -> str:
    """Return *key* if it is a usable idempotency key, else raise `InvalidKeyError`.

    A key is a non-empty string of at most 255 printable ASCII characters (space to ``~``),
    with no leading or trailing space: exactly what can travel in an HTTP header unchanged.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"an idempotency key must be a string, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("the idempotency key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"the idempotency key has {len(key)} characters; at most {MAX_KEY_LENGTH} are "
            f"allowed{_HASH_IT}"
        )
    if not (key.isascii() and key.isprintable()):  # printable ASCII is exactly " " to "~"
        position, char = next((i, c) for i, c in enumerate(key) if not " " <= c <= "~")
        raise InvalidKeyError(
            f"the idempotency key has a character that is not printable ASCII "
            f"({char!r} at position {position}){_HASH_IT}"
        )
    if key[0] == " " or key[-1] == " ":
        raise InvalidKeyError("the idempotency key starts or ends with a space")
    return key


def scope_key(scope: str, key: str) -> str:
    """Return the stored form of *key* within *scope*.

    Scopes are arbitrary strings (a function's qualified name, a route and a principal); they are
    digested when long so the stored key stays short, and separated from the key so that no two
    (scope, key) pairs collide.
    """
    if len(scope) > 64 or "|" in scope:
        scope = "h" + hashlib.sha256(scope.encode()).hexdigest()[:32]
    return f"{scope}|{key}"


def hashed_key(value: str | bytes, prefix: str = "sha256:") -> str:
    """``<prefix><SHA-256 hex of value>`` (text is encoded as UTF-8), validated."""
    data = value.encode("utf-8") if isinstance(value, str) else value
    return validate_key(f"{prefix}{hashlib.sha256(data).hexdigest()}")


def content_key(canonical: str, prefix: str = "sha256:") -> str:
    """The content key of a payload whose canonical JSON is *canonical*:
    ``<prefix>v2:<sha-256 hex>`` (`CONTENT_KEY_VERSION`)."""
    digest = hashlib.sha256(canonical.encode("ascii")).hexdigest()
    return f"{prefix}{CONTENT_KEY_VERSION}:{digest}"


def code_scope(module: str, qualname: str) -> str:
    """The scope of code named *qualname* in *module*: ``<module>.<qualname>``.

    The module is named as an ``import`` would name it even when the program was started as a
    script (``python app.py`` or ``python -m app``, where Python calls it ``__main__``), so keys
    do not depend on how the program was started.
    """
    if module == "__main__":
        module = _main_module_name()
    return f"{module}.{qualname}"


def _main_module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m package.module
        return str(spec.name).removesuffix(".__main__")
    path = getattr(main, "__file__", None)
    if not path:  # an interactive session: there is no module to name
        return "__main__"
    file = Path(path).resolve()
    parts = [file.stem]
    folder = file.parent
    while (folder / "__init__.py").is_file():  # python pkg/app.py: still pkg.app
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)
