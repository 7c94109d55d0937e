"""Test helpers: drive apps with clients that disconnect, and a fake LLM provider.

- ``drive`` calls an ASGI app in-process with a client that disconnects after N
  bytes or T seconds, or stops reading; ``lifespan`` runs its startup/shutdown.
- ``run_server`` serves an app with uvicorn, hypercorn (HTTP/1.1 or h2c) or granian
  on loopback.
- ``request`` and ``stalled_request`` are raw-socket HTTP/1.1 clients that close
  mid-stream, or keep the socket open without reading; ``h2_request`` and
  ``h2_stalled_request`` do the same over HTTP/2, where stalling means a flow-control
  window that is never reopened.
- ``FakeProvider`` streams OpenAI-chat, OpenAI-responses (with background re-attach)
  and Anthropic-messages SSE over real TCP, continues a final assistant message, and
  records, per request, how many tokens it generated before its connection closed; a
  ``Fault`` (for every request, or per request by header) makes it reset, stall, send
  garbage, end without its terminal marker or answer an error status.
"""

from __future__ import annotations

from ._driver import DriveResult, drive, lifespan
from ._fake_provider import FakeProvider, Fault, FaultKind, ProviderRequest
from ._h2_client import h2_request, h2_stalled_request
from ._servers import SERVERS, RunningServer, ServerName, run_server
from ._socket_client import ClientResult, StalledClient, request, stalled_request

__all__ = [
    "ClientResult",
    "DriveResult",
    "FakeProvider",
    "Fault",
    "FaultKind",
    "ProviderRequest",
    "RunningServer",
    "SERVERS",
    "ServerName",
    "StalledClient",
    "drive",
    "h2_request",
    "h2_stalled_request",
    "lifespan",
    "request",
    "run_server",
    "stalled_request",
]
