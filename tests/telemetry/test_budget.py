"""What telemetry adds to a request, counted: no task, nothing for the cyclic garbage
collector, one span; nothing per chunk (what it costs per chunk is in benchmarks/)."""

from __future__ import annotations

import pytest

from asgi_disconnect import MemoryBackend, install
from asgi_disconnect.testing._driver import lifespan
from tests.unit.test_metered_routes import garbage_per_request, tasks_for

from .conftest import Telemetry
from .test_spans import installed, stream_app

pytestmark = pytest.mark.anyio


async def test_telemetry_adds_no_task_and_no_cycle_per_request(telemetry: Telemetry) -> None:
    plain = stream_app()
    install(plain, backend=MemoryBackend())
    traced = installed(telemetry)
    async with lifespan(plain), lifespan(traced):
        assert await tasks_for(traced, "/v1/completion", 20) == await tasks_for(
            plain, "/v1/completion", 20
        )
        assert {span.name for span in telemetry.finished()} == {"GET /v1/completion"}
        assert len(telemetry.finished()) == 20  # one span per request, no more
        assert telemetry.count("gen_ai.client.operation.duration") == 20
        # The span, the request state and the hooks between them are freed by reference
        # counting when the request ends.
        assert await garbage_per_request(traced, "/v1/completion", 50) == 0
