"""Telemetry's cost per JSON request beside the OpenTelemetry SDK's own calls, in instructions.

Four workloads, each in a process of its own under ``valgrind --tool=callgrind``, side by
side in one run; each is counted at two lengths and the difference divided, so start-up
and warm-up cancel out:

- ``install``: ``/json`` requests through ``install()`` (``benchmarks.apps``), driven
  in-process through the ASGI callable;
- ``install-telemetry``: the same with telemetry on (SDK providers, spans batched and
  dropped, a periodic metric reader);
- ``sdk``: the SDK's calls as the budget counts them: one span with the attributes the
  package sets on it (read off a real request's span), all given at its start, ended, and
  one ``histogram.record()`` with the duration histogram's attributes;
- ``sdk-every-call``: every SDK call telemetry makes on such a request, as it makes them:
  the current context read and its span checked, the span started with the attributes a
  sampler is given (the HTTP conventions ask for them at creation) and made current
  (``context.attach`` / ``detach``), then ``is_recording()``, the rest of the attributes
  in one ``set_attributes()``, ``update_name()`` with the route, the events, ``end()``,
  and every histogram record of the request (read off a real request's metrics).

It prints telemetry's cost (the second minus the first), the SDK's calls, and the
difference: what the package spends of its own, against the budget of 30,000; then how
much of that is further SDK calls (the fourth minus the third) and how much the package's
Python (the rest). ``--each`` also counts the SDK's calls with each further call alone.

    python -m benchmarks.telemetry_budget [--requests 1000] [--each]

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
import time
from dataclasses import dataclass, field
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


@dataclass
class RequestTelemetry:
    """What telemetry asks of the SDK on one /json request, read off a real one."""

    start_name: str = ""
    kind: Any = None
    start_attributes: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int]] = field(default_factory=list)
    # (histogram name, unit, value, attributes), once per record
    records: list[tuple[str, str, float, dict[str, Any]]] = field(default_factory=list)

    @property
    def end_attributes(self) -> dict[str, Any]:
        """The attributes set after the start, in one call."""
        return {k: v for k, v in self.attributes.items() if k not in self.start_attributes}

    @property
    def duration_attributes(self) -> dict[str, Any]:
        return next(a for name, _, _, a in self.records if name == _DURATION)


_DURATION = "gen_ai.client.operation.duration"


def _request_telemetry() -> RequestTelemetry:
    """One /json request through ``install()`` with telemetry on, and what it gave the SDK:
    the name, kind and attributes a sampler saw at the span's start, the ended span, and
    the data points of every histogram."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler, SamplingResult

    from asgi_disconnect import MemoryBackend, install
    from benchmarks.apps import make_app

    seen = RequestTelemetry()

    class Watching(Sampler):
        def should_sample(self, parent_context: Any, trace_id: int, name: str,
                          kind: Any = None, attributes: Any = None, links: Any = None,
                          trace_state: Any = None) -> SamplingResult:  # fmt: skip
            seen.start_name, seen.kind = name, kind
            seen.start_attributes = dict(attributes or {})
            return ALWAYS_ON.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )

        def get_description(self) -> str:
            return "Watching"

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=Watching())
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
    seen.name = span.name
    seen.attributes = dict(span.attributes or {})
    seen.events = [(event.name, event.timestamp) for event in span.events]
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if isinstance(point, HistogramDataPoint):
                        value = point.sum / point.count
                        seen.records += [
                            (metric.name, metric.unit or "", value, dict(point.attributes or {}))
                        ] * point.count
    return seen


def _sdk_calls(workload: str) -> Any:
    """One request's SDK calls for an SDK workload: ``sdk``, ``sdk-every-call``, or ``sdk+``
    one further call (``split``, ``context``, ``rename``, ``records``)."""
    from opentelemetry import context, trace

    from benchmarks.apps import _meter_provider, _tracer_provider

    seen = _request_telemetry()
    tracer = _tracer_provider().get_tracer("bench")  # type: ignore[attr-defined]
    meter = _meter_provider().get_meter("bench")  # type: ignore[attr-defined]
    histograms = {
        name: meter.create_histogram(name, unit=unit) for name, unit, _, _ in seen.records
    }
    records = [(histograms[name], value, attributes) for name, _, value, attributes in seen.records]
    duration = histograms[_DURATION]
    attributes, duration_attributes = seen.attributes, seen.duration_attributes
    start_name, name, kind = seen.start_name, seen.name, seen.kind
    start_attributes, end_attributes = seen.start_attributes, seen.end_attributes
    events = seen.events

    def sdk() -> None:
        span = tracer.start_span(name, attributes=attributes)
        span.end()
        duration.record(0.001, duration_attributes)

    def every_call() -> None:
        parent = context.get_current()
        trace.get_current_span(parent).get_span_context().is_valid  # noqa: B018
        span = tracer.start_span(start_name, parent, kind, start_attributes)
        token = context.attach(trace.set_span_in_context(span, parent))
        context.detach(token)
        ended = time.time_ns()
        if span.is_recording():
            span.set_attributes(end_attributes)
            span.update_name(name)
            for event, at in events:
                span.add_event(event, timestamp=at)
        span.end(ended)
        for histogram, value, histogram_attributes in records:
            histogram.record(value, histogram_attributes)

    def split() -> None:  # the attributes in two calls: at the start and after
        span = tracer.start_span(name, attributes=start_attributes)
        span.set_attributes(end_attributes)
        span.end()
        duration.record(0.001, duration_attributes)

    def current() -> None:  # the span made current, after the context's span is checked
        parent = context.get_current()
        trace.get_current_span(parent).get_span_context().is_valid  # noqa: B018
        span = tracer.start_span(name, parent, kind, attributes)
        token = context.attach(trace.set_span_in_context(span, parent))
        context.detach(token)
        span.end()
        duration.record(0.001, duration_attributes)

    def rename() -> None:  # named by the route once it is known
        span = tracer.start_span(start_name, attributes=attributes)
        if span.is_recording():
            span.update_name(name)
        span.end()
        duration.record(0.001, duration_attributes)

    def all_records() -> None:  # every histogram record of the request
        span = tracer.start_span(name, attributes=attributes)
        span.end()
        for histogram, value, histogram_attributes in records:
            histogram.record(value, histogram_attributes)

    return {
        "sdk": sdk,
        "sdk-every-call": every_call,
        "sdk+split": split,
        "sdk+context": current,
        "sdk+rename": rename,
        "sdk+records": all_records,
    }[workload]


def _run(workload: str, count: int) -> None:
    """The workload, ``count`` times after a warm-up of 100."""
    import logging

    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    if workload.startswith("sdk"):
        once = _sdk_calls(workload)
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


_FURTHER = {
    "sdk+split": "the attributes in two calls (sampling ones at the start)",
    "sdk+context": "the span made current (context attach/detach)",
    "sdk+rename": "update_name() with the route",
    "sdk+records": "every histogram record, not one",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--each", action="store_true", help="also count each further SDK call alone"
    )
    parser.add_argument("--run", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args.run[0], int(args.run[1]))
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    workloads = ["install", "install-telemetry", "sdk", "sdk-every-call"]
    if args.each:
        workloads += list(_FURTHER)
    per: dict[str, float] = {}
    for workload in workloads:
        short, long = _count(workload, 0), _count(workload, args.requests)
        per[workload] = (long - short) / args.requests
    seen = _request_telemetry()
    attributes = seen.attributes
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
    every = per["sdk-every-call"]
    print(
        f"  every SDK call telemetry makes ({len(seen.start_attributes)} attributes at the "
        f"start, {len(seen.end_attributes)} after, {len(seen.records)} histogram "
        f"record(s), context attach/detach, update_name) {every:12,.0f}"
    )
    print(f"    of the package's own: further SDK calls {every - per['sdk']:+12,.0f}")
    print(f"    of the package's own: its Python        {telemetry - every:+12,.0f}")
    for workload, what in _FURTHER.items() if args.each else ():
        print(f"    the SDK's calls with {what} {per[workload] - per['sdk']:+12,.0f}")


if __name__ == "__main__":
    main()
