"""One place for the fuzzing budget: ``FUZZ_SCALE`` multiplies every property's examples."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("FUZZ_SCALE", "1")))


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples * SCALE,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
