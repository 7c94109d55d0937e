"""The exceptions the package raises on purpose.

* AsgiDisconnectError
  * BackendUnavailable: a store cannot be reached or opened (``await backend.open()``,
    lifespan startup); the driver's own error is its ``__cause__``.
  * IdempotencyKeyRequired: an ``@idempotent(required=True)`` endpoint got no key.
  * UpstreamStreamError: an upstream stream failed (``asgi_disconnect.upstream``)
    * UpstreamStatusError, UpstreamUnreachable, FirstTokenTimeout, IdleTimeout,
      TruncatedStream

A low module: every other module may import it, and it imports none of the package. The
public names are ``asgi_disconnect``'s and ``asgi_disconnect.upstream``'s.

Configuration mistakes found before anything connects (a malformed backend URL, a bad
option) are ``ValueError``, as in the standard library.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AsgiDisconnectError",
    "BackendUnavailable",
    "FirstTokenTimeout",
    "IdempotencyKeyRequired",
    "IdleTimeout",
    "TruncatedStream",
    "UpstreamStatusError",
    "UpstreamStreamError",
    "UpstreamUnreachable",
]


class AsgiDisconnectError(Exception):
    """Base class of every exception the package raises on purpose."""


class BackendUnavailable(AsgiDisconnectError):
    """The store cannot be reached or opened; the message says why and what to do."""


class IdempotencyKeyRequired(AsgiDisconnectError):
    """Raised by an ``@idempotent(required=True)`` endpoint called without a key."""


class UpstreamStreamError(AsgiDisconnectError):
    """The upstream stream failed; ``error_type`` says how (the type of the client's error
    frame and of the usage record's ``error_type``), ``error`` is the provider's error
    payload when it sent one."""

    error_type = "upstream_error"

    def __init__(self, message: str, *, error: Any = None) -> None:
        super().__init__(message)
        self.error = error


class UpstreamStatusError(UpstreamStreamError):
    """The upstream refused the request: ``status_code``, its error body (JSON decoded
    when it is JSON) in ``error``, and its ``Retry-After`` if it sent one."""

    error_type = "upstream_status"

    def __init__(self, status_code: int, error: Any, retry_after: str | None = None) -> None:
        super().__init__(f"the upstream answered {status_code}", error=error)
        self.status_code = status_code
        self.retry_after = retry_after


class UpstreamUnreachable(UpstreamStreamError):
    """The request did not reach the upstream, or its response's head did not come back:
    a refused connection, a name that does not resolve, a connection reset before the
    headers. The client library's error is the ``__cause__``."""

    error_type = "upstream_unreachable"


class FirstTokenTimeout(UpstreamStreamError):
    """No event arrived within ``first_token_timeout`` of sending the request."""

    error_type = "first_token_timeout"


class IdleTimeout(UpstreamStreamError):
    """No event arrived for ``idle_timeout`` after the last one (comments do not count)."""

    error_type = "idle_timeout"


class TruncatedStream(UpstreamStreamError):
    """The body ended without its protocol's terminal marker."""

    error_type = "truncated_stream"
