"""Telemetry's cost per JSON request beside the OpenTelemetry SDK's own calls, in instructions.

Three workloads, each in a process of its own under ``valgrind --tool=callgrind``, side by
side in one run; each is counted at two lengths and the difference divided, so start-up
and warm-up cancel out:

- ``install``: ``/json`` requests through ``install()`` (``benchmarks.apps``), driven
  in-process through the ASGI callable;
- ``install-telemetry``: the same with telemetry on (SDK providers, spans batched and
  dropped, a periodic metric reader);
- ``sdk``: what the SDK itself costs for what telemetry asks of it on such a request: one
  span with the attributes the package sets on it (read off a real request's span), ended,
  and one ``histogram.record()`` with the duration histogram's attributes.

It prints telemetry's cost (the second minus the first), the SDK's calls, and the
difference: what the package spends of its own, against the budget of 30,000.

    python -m benchmarks.telemetry_budget [--requests 1000]

Needs valgrind and ``pip install -e '.[otel]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from typing import Any

BUDGET = 30_000
_SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.3"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "path": "/json",
    "raw_path": b"/json",
    "query_string": b"",
    "root_path": "",
    "headers": [(b"host", b"bench")],
    "client": ("127.0.0.1", 50000),
    "server": ("127.0.0.1", 8000),
}


async def _request(app: Any) -> None:
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(dict(_SCOPE), receive, send)


def _span_attributes() -> tuple[dict[str, Any], dict[str, Any]]:
    """What telemetry sets on a /json request's span, and on its duration histogram."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from asgi_disconnect import MemoryBackend, install
    from benchmarks.apps import make_app

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    app = make_app()
    install(
        app,
        backend=MemoryBackend(),
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
    )

    async def one() -> None:
        await _request(app)
        await asyncio.sleep(0.05)

    asyncio.run(one())
    (span,) = spans.get_finished_spans()
    histogram: dict[str, Any] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "gen_ai.client.operation.duration":
                    histogram = dict(metric.data.data_points[0].attributes or {})
    return dict(span.attributes or {}), histogram


def _run(workload: str, count: int) -> None:
    """The workload, ``count`` times after a warm-up of 100."""
    import logging

    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    if workload == "sdk":
        from benchmarks.apps import _meter_provider, _tracer_provider

        attributes, histogram_attributes = _span_attributes()
        tracer = _tracer_provider().get_tracer("bench")  # type: ignore[attr-defined]
        histogram = (
            _meter_provider()  # type: ignore[attr-defined]
            .get_meter("bench")
            .create_histogram("gen_ai.client.operation.duration", unit="s")
        )

        def once() -> None:
            span = tracer.start_span("GET /json", attributes=attributes)
            span.end()
            histogram.record(0.001, histogram_attributes)

        for _ in range(100 + count):
            once()
        return
    from benchmarks.apps import installed_app, installed_telemetry_app

    app = installed_telemetry_app() if workload == "install-telemetry" else installed_app()

    async def main() -> None:
        for _ in range(100 + count):
            await _request(app)
        await asyncio.sleep(0.05)

    asyncio.run(main())


def _count(workload: str, count: int) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.telemetry_budget",
            "--run",
            workload,
            str(count),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    match = re.search(r"Collected : (\d+)", out.stderr)
    if match is None:
        raise RuntimeError(out.stderr[-2000:])
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--run", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args.run[0], int(args.run[1]))
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    per: dict[str, float] = {}
    for workload in ("install", "install-telemetry", "sdk"):
        short, long = _count(workload, 0), _count(workload, args.requests)
        per[workload] = (long - short) / args.requests
    attributes, _ = _span_attributes()
    telemetry = per["install-telemetry"] - per["install"]
    own = telemetry - per["sdk"]
    print("in-process, per /json request, instructions")
    print(f"  telemetry on, over install()          {telemetry:+12,.0f}")
    print(
        f"  the SDK's calls alone ({len(attributes)} span attributes, "
        f"one histogram record) {per['sdk']:12,.0f}"
    )
    verdict = "within" if own <= BUDGET else "over"
    print(f"  the package's own                     {own:+12,.0f}  ({verdict} {BUDGET:,})")


if __name__ == "__main__":
    main()
