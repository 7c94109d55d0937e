"""Wheel build hook: compile the SSE decoder with mypyc where this machine can, else stay pure.

``asgi_disconnect/sse.py`` is plain, fully typed Python; mypyc turns it into a C extension that
decodes small chunks about twice as fast (see docs/performance.md). The source is the same
either way and every test runs against both. When compiling fails (no C compiler, no Python
headers), the wheel is pure Python and a warning says why. ``ASGI_DISCONNECT_PURE_PYTHON=1``
builds pure Python on purpose and removes a compiled decoder left in the source tree.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hatch_mypyc.plugin import MypycBuildHook


class CompiledDecoderHook(MypycBuildHook):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("ASGI_DISCONNECT_PURE_PYTHON", "") not in ("", "0"):
            self.clean([version])
            return
        try:
            super().initialize(version, build_data)
        except Exception as exc:  # a build that cannot compile still installs
            self.clean([version])
            print(
                f"asgi_disconnect: the SSE decoder was not compiled (pure Python wheel): {exc}",
                file=sys.stderr,
            )


def get_build_hook() -> type[CompiledDecoderHook]:
    return CompiledDecoderHook
