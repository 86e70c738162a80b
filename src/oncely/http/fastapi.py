"""FastAPI: a route's key owned by the app's own current-user dependency.

FastAPI apps usually authenticate in a dependency (``Depends(current_user)``), which runs inside
the route, after every middleware. `idempotent_for` wraps that dependency: FastAPI runs the
app's authentication exactly as before (once per request), and the principal it names owns the
request's key, so a refreshed token or rotated cookie between two attempts still replays.

.. code-block:: python

    from fastapi import Depends, FastAPI
    from oncely.http import HttpPolicy
    from oncely.http.asgi import IdempotencyMiddleware
    from oncely.http.fastapi import FROM_DEPENDENCY, idempotent_for

    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware, store=store, policy=HttpPolicy(principal=FROM_DEPENDENCY)
    )
    owned = idempotent_for(current_user)

    @app.post("/payments", dependencies=[Depends(owned)])
    def pay(user: User = Depends(current_user)) -> dict[str, str]: ...

Under ``principal=FROM_DEPENDENCY`` (app-wide, or a route's `RouteOptions`), the middleware
reads and fingerprints a covered request as always but does not claim its key: it parks the
request in the ASGI scope. The dependency claims it, through the same flow as any other
request, with the owner its user names. Acquired: the handler runs and its response is stored.
Anything else (a replay, 409, 422, 503): the dependency raises, the handler never runs, and the
middleware answers the prepared response in place of whatever the app sends for the exception.

Protection is opt-in per route: a route in that mode without the dependency is served
unprotected, with a warning once per route. The dependency without the middleware, or under a
policy not in that mode, raises `oncely.ConfigurationError` (a 500): it never lets the handler
run unprotected unnoticed. Nothing here imports FastAPI until `idempotent_for` is called.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import enum
import functools
import importlib
import inspect
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final

from oncely import _execution, _switches
from oncely._core.protocols import AsyncStore
from oncely._log import fields, get_logger
from oncely.errors import ConfigurationError
from oncely.http import _flow, _semantics
from oncely.http._policy import HttpPolicy
from oncely.http._semantics import Header, Response
from oncely.http._types import Message, Scope, Send

__all__ = ["FROM_DEPENDENCY", "default_principal", "idempotent_for"]

logger = get_logger("oncely.http")

_PARKED: Final = "oncely.parked"
"""The ASGI scope key of a request whose claim waits for the dependency."""

_WARNED_LIMIT: Final = 1024
_warned: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
"""The routes of each app already warned about a missing dependency (bounded: paths that match
no route would otherwise grow it without end)."""


class _FromDependency:
    """The principal source of `FROM_DEPENDENCY`: only `idempotent_for` knows the principal."""

    __slots__ = ()

    def __call__(self, request: object) -> str | None:
        raise ConfigurationError(
            "principal=FROM_DEPENDENCY names the principal from oncely.http.fastapi."
            "idempotent_for, which only the ASGI middleware (oncely.http.asgi) runs with"
        )

    def __repr__(self) -> str:
        return "FROM_DEPENDENCY"


FROM_DEPENDENCY: Final = _FromDependency()
"""``HttpPolicy(principal=FROM_DEPENDENCY)``: the principal is the user the route's
`idempotent_for` dependency returns, and the key is claimed when that dependency runs."""


class _State(enum.Enum):
    WAITING = "waiting"  # the dependency has not run
    CLAIMED = "claimed"  # it holds the lease: the middleware captures and settles the response
    REFUSED = "refused"  # it prepared an answer: the app's response to the refusal is replaced
    UNPROTECTED = "unprotected"  # no claim for this request (no key, not covered, fail-open)


class _Parked:
    """A request of a `FROM_DEPENDENCY` route, between the middleware and the dependency."""

    __slots__ = ("answer", "calls", "lease", "parts", "policy", "route", "sent", "state")

    def __init__(self, policy: HttpPolicy, route: str) -> None:
        self.policy = policy
        self.route = route
        self.calls: AsyncStore | None = None
        self.parts: tuple[str, str, bytes, tuple[Header, ...], bytes, str | None, str] | None = None
        self.state = _State.UNPROTECTED  # until parked: no key, or not covered
        self.lease: _execution.Lease | None = None
        self.answer: Response | None = None
        self.sent = False  # the prepared answer went out

    def park(
        self,
        calls: AsyncStore,
        method: str,
        path: str,
        query: bytes,
        headers: tuple[Header, ...],
        body: bytes,
        user: str | None,
        key: str,
    ) -> None:
        """Keep what the claim needs: the store, the request's parts and its key."""
        self.calls = calls
        self.parts = (method, path, query, headers, body, user, key)
        self.state = _State.WAITING

    async def claim(self, principal: str | None) -> None:
        """Claim the parked request's key, owned by *principal* (`_flow.begin`'s rules)."""
        assert self.parts is not None, "claimed before parked"
        assert self.calls is not None, "claimed before parked"
        method, path, query, headers, body, user, key = self.parts
        policy = self.policy
        plan = _semantics.plan_parts(
            method, path, self.route, query, headers, body, user, key, policy, principal
        )
        if isinstance(plan, Response):
            self.state, self.answer = _State.REFUSED, plan
            return
        outcome = await _execution.arun(
            _flow.begin(plan, policy, method=method, path=path), self.calls
        )
        if outcome is _flow.PASS_THROUGH:
            self.state = _State.UNPROTECTED
        elif isinstance(outcome, Response):
            self.state, self.answer = _State.REFUSED, outcome
        else:
            self.state, self.lease = _State.CLAIMED, outcome
            _execution.CURRENT.set(outcome)  # `oncely.current_lease()` in the handler

    async def unclaimed(self, message: Message, send: Send, scope: Scope) -> None:
        """Send (or replace) one response message of a request the dependency did not claim."""
        if self.state is _State.REFUSED:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await self.send_answer(send)
            return
        if self.state is _State.WAITING and message["type"] == "http.response.start":
            self.state = _State.UNPROTECTED
            _warn_if_missing(scope, f"{scope.get('method')} {self.route}")
        await send(message)

    async def answers(self, exc: BaseException | None, send: Send) -> bool:
        """Whether the app's end, on *exc* (``None``: it returned), is answered by the prepared
        answer: the refusal reached the middleware, or the app sent nothing for it."""
        if self.answer is None or (exc is not None and not isinstance(exc, _refusal())):
            return False
        await self.send_answer(send)
        return True

    async def send_answer(self, send: Send) -> None:
        """Send the prepared answer, once."""
        if self.answer is not None and not self.sent:
            self.sent = True
            await send(
                {
                    "type": "http.response.start",
                    "status": self.answer.status,
                    "headers": list(self.answer.headers),
                }
            )
            await send({"type": "http.response.body", "body": self.answer.body})


def _parking(policy: HttpPolicy, route: str, scope: Scope) -> tuple[Scope, _Parked | None]:
    """*scope* marked for the dependency when *policy* takes the principal from it."""
    if policy.principal is not FROM_DEPENDENCY:
        return scope, None
    parked = _Parked(policy, route)
    return {**scope, _PARKED: parked}, parked


def _warn_if_missing(scope: Scope, route: str) -> None:
    """Warn, once per route, that a route in `FROM_DEPENDENCY` mode has no dependency (a route
    that has it, whose earlier dependency refused the request, claimed nothing: no warning)."""
    dependant = getattr(scope.get("route"), "dependant", None)
    if dependant is not None and _declares(dependant):
        return
    app = scope.get("app")
    try:
        warned = _warned.setdefault(app, set())
    except TypeError:  # no app in the scope, or one without weak references
        warned = _warned.setdefault(_warn_if_missing, set())
    if route in warned or len(warned) >= _WARNED_LIMIT:
        return
    warned.add(route)
    logger.warning(
        "route %s takes its principal from a dependency (principal=FROM_DEPENDENCY) but has no "
        "Depends(oncely.http.fastapi.idempotent_for(...)): served UNPROTECTED",
        route,
        extra=fields(outcome="unprotected"),
    )


def _declares(dependant: Any) -> bool:
    stack = [dependant]
    while stack:
        node = stack.pop()
        if getattr(getattr(node, "call", None), _MARK, False):
            return True
        stack.extend(getattr(node, "dependencies", ()) or ())
    return False


_MARK: Final = "__oncely_idempotent_for__"


def default_principal(user: object) -> str | None:
    """The principal a user object names: a string is its own name; a framework user its
    `oncely.http.HttpRequest.principal` name (``identity``, ``pk``, ``id``...); else its
    ``id``; ``None`` is anonymous.

    Raises:
        ConfigurationError: The user names nobody this way (pass ``principal=``).
    """
    if user is None or isinstance(user, str):
        return user or None
    if hasattr(user, "is_authenticated"):
        return _semantics.user_principal(user)
    ident = getattr(user, "id", None)
    if ident is not None and not isinstance(ident, bool):
        return str(ident)
    raise ConfigurationError(
        f"idempotent_for cannot name a principal from a {type(user).__name__}: pass "
        "principal=, a callable from the user to its stable id"
    )


def idempotent_for(
    current_user: Callable[..., Any],
    *,
    principal: Callable[[Any], str | Awaitable[str | None] | None] = default_principal,
) -> Callable[..., Awaitable[Any]]:
    """A FastAPI dependency that claims the request's key for the user *current_user* returns.

    Put it on the routes to protect (``dependencies=[Depends(idempotent_for(current_user))]``
    on the route, its router or the app) under ``HttpPolicy(principal=FROM_DEPENDENCY)``. It
    depends on *current_user* as the route does (FastAPI runs it once per request), turns the
    user into a principal with *principal*, and claims the key the middleware parked. It
    returns the user, so it can stand in for *current_user* in the route's parameters.

    Args:
        current_user: The app's own dependency returning the authenticated user (it keeps
            raising 401 itself: nothing is claimed then).
        principal: The user's stable name, sync or async; ``None`` is anonymous. By default
            `default_principal`.

    Raises:
        ConfigurationError: When the dependency runs for a request the ASGI middleware did not
            park: no middleware, or a policy whose principal is not `FROM_DEPENDENCY`.

    .. versionadded:: 0.1.0
    """
    if not callable(current_user):
        raise ConfigurationError("idempotent_for needs the app's current-user dependency")
    if not callable(principal):
        raise ConfigurationError("principal must be a callable from the user to its name")
    fastapi = importlib.import_module("fastapi")
    refused = _refusal()

    async def dependency(request: Any, user: Any) -> Any:
        scope: Scope = request.scope
        parked = scope.get(_PARKED)
        if not isinstance(parked, _Parked):
            method = scope.get("method", "")
            if method in _semantics.SAFE_METHODS or _switches.off(method, scope.get("path", "")):
                return user
            raise ConfigurationError(
                "idempotent_for ran for a request oncely did not park: add oncely.http.asgi."
                "IdempotencyMiddleware with HttpPolicy(principal=FROM_DEPENDENCY) (or that "
                "route option) for this route"
            )
        if parked.state is not _State.WAITING:  # declared twice on one route: claimed once
            return user
        name = principal(user)
        if inspect.isawaitable(name):
            name = await name
        if name is not None and not isinstance(name, str):
            raise TypeError(f"the principal callable returned {type(name).__name__}, not str")
        await parked.claim(name or None)
        if parked.answer is not None:
            raise refused(parked.answer.status)
        return user

    dependency.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=fastapi.Request
            ),
            inspect.Parameter(
                "user",
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=fastapi.Depends(current_user),
                annotation=Any,
            ),
        ]
    )
    name = getattr(current_user, "__name__", type(current_user).__name__)
    dependency.__name__ = dependency.__qualname__ = f"idempotent_for({name})"
    setattr(dependency, _MARK, True)
    return dependency


@functools.cache
def _refusal() -> type[Exception]:
    """The exception that stops a refused request's handler: a FastAPI ``HTTPException``, which
    FastAPI's own handler answers (replaced by the middleware), so an app-wide
    ``exception_handler(Exception)`` never sees it."""
    base = importlib.import_module("fastapi").HTTPException
    refusal: type[Exception] = type(
        "IdempotencyRefused",
        (base,),
        {
            "__doc__": "The request was answered by oncely (replay, 409, 422, 503): the "
            "handler does not run.",
            "__module__": __name__,
        },
    )
    return refusal
