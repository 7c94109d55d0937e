"""Test helpers: drive apps with clients that disconnect, and a fake LLM provider."""

from __future__ import annotations

from ._driver import DriveResult, drive, lifespan
from ._servers import RunningServer, run_server

__all__ = ["DriveResult", "RunningServer", "drive", "lifespan", "run_server"]
