"""`@idempotent`: make a sync or async function take effect once per key.

.. code-block:: python

    @oncely.idempotent(store=store, key="order_id", final_errors=(CardDeclined,))
    def charge(order_id: str, amount_cents: int) -> Receipt:
        ...

    charge("o-1", 500)            # runs
    charge(order_id="o-1", amount_cents=500)   # same key: replays the stored Receipt
    charge("o-1", 900)            # same key, other arguments: FingerprintMismatchError

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import enum
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, ParamSpec, Protocol, TypeVar

from oncely import _events, _execution, _observed, _switches
from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import arguments_digest, digest
from oncely._core.keys import MAX_KEY_LENGTH, code_scope, name_key, scope_key, validate_key
from oncely._core.policy import UNSET, Duration, Policy, _Unset, derive
from oncely._core.protocols import AsyncStore, SyncStore
from oncely.errors import ConfigurationError
from oncely.stores import open_store

__all__ = ["IdempotentFunction", "KeyFunc", "idempotent"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

KeyFunc = Callable[..., str]
"""A callable over the function's arguments that returns the idempotency key."""

_IMPLICIT = frozenset({"self", "cls"})


class _AllArguments(enum.Enum):
    ALL = "ALL"

    def __repr__(self) -> str:
        return "ALL_ARGUMENTS"


_ALL: Final = _AllArguments.ALL


class IdempotentFunction(Protocol[P, R_co]):
    """A function wrapped by `idempotent`: same signature, plus the attributes below."""

    policy: Policy
    """The behaviour of this operation."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co:
        """Run once per key, replaying the stored outcome to duplicates."""
        ...

    def with_key(self, key: str) -> Callable[P, R_co]:
        """Return the function bound to an explicit *key*, overriding the key specification."""
        ...


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's own __call__
    )


_PLAIN_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclass(eq=False)
class _CallPlan:
    """Everything decided when the decorator is applied, so each call only reads arguments.

    For a signature of plain parameters (no ``*args``, ``**kwargs`` or positional-only ones),
    a call's arguments are matched to names by position and keyword directly, which is what
    `inspect.Signature.bind` and ``apply_defaults`` find for every call they accept; any call
    this does not settle (a missing or unexpected argument...) goes through them, and they
    raise the `TypeError` Python would.
    """

    fn: Callable[..., Any]
    store: Any
    signature: inspect.Signature
    scope: str
    key: str | KeyFunc
    fingerprint: Sequence[str] | Callable[..., Any] | object | None
    policy: Policy
    codec: Codec

    def __post_init__(self) -> None:
        parameters = self.signature.parameters.values()
        plain = all(parameter.kind in _PLAIN_KINDS for parameter in parameters)
        self._names = tuple(self.signature.parameters)
        self._positional = sum(p.kind is _PLAIN_KINDS[0] for p in parameters) if plain else -1
        self._defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        self._prefix = scope_key(self.scope, "")  # + the key: `scope_key`'s stored form
        spec = self.fingerprint
        if spec is _ALL:
            spec = [name for name in self._names if name not in _IMPLICIT]
        self._fingerprinted: tuple[str, ...] | None = (
            tuple(typing.cast(Sequence[str], spec))
            if spec is not None and not callable(spec)
            else None
        )
        self._all_fingerprinted = self._fingerprinted == self._names

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments of a call by name, defaults included (``BoundArguments.arguments``)."""
        if 0 <= len(args) <= self._positional:
            # No strict=: it stops at the last argument, and the keyword costs a slower call.
            arguments = dict(zip(self._names, args))  # noqa: B905
            for name, value in kwargs.items():
                if name in arguments or name not in self._names:
                    break  # the binding's error to raise
                arguments[name] = value
            else:
                if len(arguments) == len(self._names):
                    return arguments
                for name in self._names:
                    if name not in arguments:
                        if name not in self._defaults:
                            break
                        arguments[name] = self._defaults[name]
                else:
                    return arguments
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def call_arguments(self, arguments: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(BoundArguments.args, BoundArguments.kwargs)`` of *arguments*, for the callables."""
        bound = inspect.BoundArguments(self.signature, arguments)
        return bound.args, bound.kwargs

    def invocation(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], explicit: str | None
    ) -> tuple[Any, str, str, Policy, Codec, Any, Callable[[], Any]]:
        """The arguments of `_execution.call` (or ``acall``) for a call: the store, the scoped
        key, the fingerprint..."""
        arguments = self.arguments(args, kwargs)
        if explicit is not None:
            key = explicit
        elif isinstance(self.key, str):
            key = arguments[self.key]
        else:
            positional, named = self.call_arguments(arguments)
            key = self.key(*positional, **named)
        if not (
            type(key) is str
            and 0 < len(key) <= MAX_KEY_LENGTH
            and key.isascii()
            and key.isprintable()
            and key[0] != " "
            and key[-1] != " "
        ):  # else `validate_key` says why, or `name_key` makes it one
            key = validate_key(name_key(key))
        names = self._fingerprinted
        if names is not None:
            if not self._all_fingerprinted:
                arguments = {name: arguments[name] for name in names}
            fingerprint = arguments_digest(arguments)
        elif self.fingerprint is None:
            fingerprint = ""
        else:
            positional, named = self.call_arguments(arguments)
            fingerprint = digest([self.fingerprint(*positional, **named)])  # type: ignore[operator]
        return (
            self.store if _switches.store is None else _switches.store,
            self._prefix + key,
            fingerprint,
            self.policy,
            self.codec,
            self.annotation,
            lambda: self.fn(*args, **kwargs),
        )

    @functools.cached_property
    def annotation(self) -> Any:
        try:
            return typing.get_type_hints(self.fn).get("return", Any)
        except Exception:  # unresolvable forward references: replay plain JSON
            return Any


class idempotent:
    """Decorate a function so that it takes effect once per key.

    Args:
        store: A store object, or a store URL opened with `oncely.open_store`.
        key: The name of the parameter holding the key, or a callable over the function's
            arguments that returns it. Positional and keyword calls give the same key.
        scope: The key's namespace (default: the function's module and qualified name). Set it
            explicitly to keep keys valid across a rename.
        fingerprint: What defines "the same operation": by default every argument (``self`` and
            ``cls`` excepted); a list of parameter names; a callable over the arguments returning
            any canonicalisable value; or ``None`` to skip the check.
        policy: The base `Policy`; the keyword arguments below override single fields of it.
        ttl: How long the outcome is replayed (timedelta or seconds).
        lease: How long the lease lasts between heartbeats.
        on_conflict: For a concurrent duplicate: ``"raise"`` (`InProgressError`) or ``"wait"``
            (bounded by ``wait_timeout``) for the first call's outcome.
        wait_timeout: How long ``"wait"`` waits at most.
        final_errors: Exception types that are stored and replayed as the same type; any other
            exception releases the lease so that a retry executes.
        heartbeat: Keep the lease alive while the function runs (default on).
        codec: Serialises return values (JSON by default, with dataclasses and pydantic models).

    Raises:
        ConfigurationError: At decoration time, for a key parameter the function does not have,
            or a store that cannot serve this kind of function.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        *,
        store: SyncStore | AsyncStore | str,
        key: str | KeyFunc,
        scope: str | None = None,
        fingerprint: Sequence[str] | Callable[..., Any] | _AllArguments | None = _ALL,
        policy: Policy | None = None,
        ttl: Duration | _Unset = UNSET,
        lease: Duration | _Unset = UNSET,
        on_conflict: Literal["raise", "wait"] | _Unset = UNSET,
        wait_timeout: Duration | _Unset = UNSET,
        final_errors: tuple[type[BaseException], ...] | _Unset = UNSET,
        heartbeat: bool | _Unset = UNSET,
        codec: Codec | None = None,
    ) -> None:
        self.store = open_store(store) if isinstance(store, str) else store
        if not (isinstance(key, str) or callable(key)):
            raise ConfigurationError(f"key must be a parameter name or a callable, not {key!r}")
        if isinstance(fingerprint, str):
            raise ConfigurationError("fingerprint takes a list of parameter names, not a string")
        self.key = key
        self.scope = scope
        self.fingerprint = fingerprint
        self.policy = derive(
            policy,
            ttl=ttl,
            lease=lease,
            on_conflict=on_conflict,
            wait_timeout=wait_timeout,
            final_errors=final_errors,
            heartbeat=heartbeat,
        )
        self.codec: Codec = codec or JSONCodec()

    def __call__(self, fn: Callable[P, R]) -> IdempotentFunction[P, R]:
        """Wrap *fn*."""
        if not callable(fn):
            raise ConfigurationError(f"@idempotent decorates functions, not {fn!r}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise ConfigurationError(
                f"{fn.__qualname__}() is a generator function: its results arrive after the call "
                "returns and cannot be stored; make a function that returns a list instead"
            )
        _check_result_type(fn, self.codec)
        signature = inspect.signature(fn)
        for name in ([self.key] if isinstance(self.key, str) else []) + (
            list(self.fingerprint) if isinstance(self.fingerprint, (list, tuple)) else []
        ):
            if name not in signature.parameters:
                raise ConfigurationError(
                    f"{fn.__qualname__}() has no parameter {name!r} "
                    f"(parameters: {', '.join(signature.parameters)})"
                )
        plan = _CallPlan(
            fn=fn,
            store=self.store,
            signature=signature,
            scope=self.scope or default_scope(fn),
            key=self.key,
            fingerprint=self.fingerprint,
            policy=self.policy,
            codec=self.codec,
        )
        if _is_async(fn):
            if not isinstance(self.store, AsyncStore):
                raise ConfigurationError(
                    f"{type(self.store).__name__} has no async verbs; it cannot serve the "
                    f"coroutine function {fn.__qualname__}()"
                )
            return typing.cast(IdempotentFunction[P, R], _async_wrapper(plan))
        if not isinstance(self.store, SyncStore):
            raise ConfigurationError(
                f"{type(self.store).__name__} has no sync verbs; it cannot serve "
                f"{fn.__qualname__}()"
            )
        return typing.cast(IdempotentFunction[P, R], _sync_wrapper(plan))


def default_scope(fn: Callable[..., Any]) -> str:
    """The default scope of a decorated function: its module's import name and qualified name.

    The module is named as an ``import`` would name it even when the program was started as a
    script (``python app.py`` or ``python -m app``, where Python calls it ``__main__``), so keys
    do not depend on how the program was started.
    """
    return code_scope(fn.__module__, fn.__qualname__)


def _check_result_type(fn: Callable[..., Any], codec: Codec) -> None:
    check = getattr(codec, "check", None)
    if check is None:
        return
    try:
        annotation = typing.get_type_hints(fn).get("return", Any)
    except Exception:  # a forward reference not defined yet: judged at the first call
        return
    try:
        check(annotation)
    except TypeError as exc:
        raise ConfigurationError(f"{fn.__qualname__}(): {exc}") from None


def _unprotected(plan: _CallPlan) -> None:
    _switches.warn_unprotected(plan.scope, scope=plan.scope)


def _sync_wrapper(plan: _CallPlan) -> Any:
    def keyed(key: str | None) -> Callable[..., Any]:
        @functools.wraps(plan.fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _switches.disabled:
                _unprotected(plan)
                return plan.fn(*args, **kwargs)
            if _events.on:
                return _observed_call(plan, args, kwargs, key)
            return _execution.call(*plan.invocation(args, kwargs, key))

        return wrapper

    return _wrapped(plan, keyed)


def _async_wrapper(plan: _CallPlan) -> Any:
    def keyed(key: str | None) -> Callable[..., Any]:
        @functools.wraps(plan.fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _switches.disabled:
                _unprotected(plan)
                return await plan.fn(*args, **kwargs)
            if _events.on:
                return await _observed_acall(plan, args, kwargs, key)
            return await _execution.acall(*plan.invocation(args, kwargs, key))

        return wrapper

    return _wrapped(plan, keyed)


def _wrapped(plan: _CallPlan, keyed: Callable[[str | None], Callable[..., Any]]) -> Any:
    """The decorated function: *keyed* (None) is it, *keyed* (key) its ``with_key(key)``."""
    wrapper: Any = keyed(None)
    wrapper.policy = plan.policy
    wrapper.with_key = keyed
    wrapper._oncely_plan = plan  # for oncely.testing
    return wrapper


def _observed_call(
    plan: _CallPlan, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None
) -> Any:
    """A decorated call, observed (only while something subscribes to oncely's events)."""
    with _observed.observing("function", plan.scope, plan.store):
        store, *rest = plan.invocation(args, kwargs, key)
        return _execution.call(_observed.timed(store), *rest)


async def _observed_acall(
    plan: _CallPlan, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None
) -> Any:
    """An async decorated call, observed."""
    with _observed.observing("function", plan.scope, plan.store):
        store, *rest = plan.invocation(args, kwargs, key)
        return await _execution.acall(_observed.timed(store), *rest)
