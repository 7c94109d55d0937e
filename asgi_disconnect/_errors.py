"""The exceptions the package raises on purpose.

* AsgiDisconnectError
  * BackendUnavailable: a store cannot be reached or opened (``await backend.open()``,
    lifespan startup); the driver's own error is its ``__cause__``.
  * IdempotencyKeyRequired: an ``@idempotent(required=True)`` endpoint got no key.

Configuration mistakes found before anything connects (a malformed backend URL, a bad
option) are ``ValueError``, as in the standard library.
"""

from __future__ import annotations

__all__ = ["AsgiDisconnectError", "BackendUnavailable"]


class AsgiDisconnectError(Exception):
    """Base class of every exception the package raises on purpose."""


class BackendUnavailable(AsgiDisconnectError):
    """The store cannot be reached or opened; the message says why and what to do."""
