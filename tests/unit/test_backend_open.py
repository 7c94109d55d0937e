"""Every way a backend can fail to open is one exception that says why and what to do."""

from __future__ import annotations

import pytest

from asgi_disconnect import BackendUnavailable
from asgi_disconnect._errors import AsgiDisconnectError


def test_backend_unavailable_is_the_package_error_not_an_os_error() -> None:
    # Code that catches OSError around a send must not swallow a store that is down.
    assert issubclass(BackendUnavailable, AsgiDisconnectError)
    assert not issubclass(BackendUnavailable, OSError)
    with pytest.raises(AsgiDisconnectError):
        raise BackendUnavailable("down")
