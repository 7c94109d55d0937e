"""Disconnect policies and the per-route decorator."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeVar

# The policies are the contract's words (a request's state says which one applied); how a
# route chooses one is here.
from ._contract import Policy

if TYPE_CHECKING:
    from starlette.types import Scope

__all__ = ["Policy", "PolicyLike", "PolicySource", "disconnect_policy"]


PolicyLike = Policy | Literal["cancel", "detach"]
PolicySource = PolicyLike | Callable[["Scope"], PolicyLike]

POLICY_ATTRIBUTE = "__asgi_disconnect_policy__"

_F = TypeVar("_F", bound=Callable[..., object])


def coerce_policy(value: object) -> Policy:
    try:
        return Policy(value)  # type: ignore[arg-type]
    except ValueError:
        close = difflib.get_close_matches(str(value), [p.value for p in Policy], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"disconnect policy must be 'cancel' or 'detach', not {value!r}{hint}"
        ) from None


def check_source(source: PolicySource) -> PolicySource:
    """Validate a constant policy now; a callable is checked each time it answers."""
    return source if callable(source) else coerce_policy(source)


def disconnect_policy(policy: PolicySource) -> Callable[[_F], _F]:
    """Choose the disconnect policy of an endpoint.

    ``policy`` is ``"cancel"``, ``"detach"`` or a callable ``(scope) -> policy`` that is
    called once, when the client disconnects, so it can read tenant configuration or the
    request's progress (``scope["asgi_disconnect"]``).
    """
    source = check_source(policy)

    def decorate(endpoint: _F) -> _F:
        setattr(endpoint, POLICY_ATTRIBUTE, source)
        return endpoint

    return decorate


def route_policy(scope: Scope) -> PolicySource | None:
    """The policy declared on the routed endpoint, if routing has happened."""
    endpoint = scope.get("endpoint")
    source = getattr(endpoint, POLICY_ATTRIBUTE, None)
    if source is None:
        route = scope.get("route")
        source = getattr(getattr(route, "endpoint", None), POLICY_ATTRIBUTE, None)
    return source


def resolve_policy(source: PolicySource, scope: Scope) -> Policy:
    if isinstance(source, Policy):
        return source
    if callable(source):
        return coerce_policy(source(scope))
    return coerce_policy(source)
