"""SSEDecoder under arbitrary bytes: how a body is cut never changes what it means.

Whatever the bytes and wherever they are cut, the decoder gives the events, last event ID,
comment count and retry of the body fed whole and of the WHATWG algorithm applied literally;
with small limits the outcome (events, or ``SSEDecodeError``) does not depend on the cuts
either, and nothing but ``SSEDecodeError`` ever escapes. Both builds run: the compiled
extension (when the install compiled one) and ``sse.py`` as plain Python.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asgi_disconnect import sse
from tests.fuzz._settings import fuzz

SOURCE = Path(sse.__file__).with_name("sse.py")


def _plain_python() -> ModuleType:
    name = "asgi_disconnect._sse_fuzzed_as_python"
    spec = importlib.util.spec_from_file_location(name, SOURCE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec resolves the event's annotations through it
    spec.loader.exec_module(module)
    return module


BUILDS = {"installed": sse, "python": _plain_python()}
if sse.__file__.endswith(".py"):
    del BUILDS["python"]  # the installed one is already plain Python

Event = tuple[str, str, str, int | None]
FUZZ = fuzz(300)


def oracle(body: bytes) -> tuple[list[Event], str, int, int | None]:
    """The spec's "interpreting an event stream", line by line over the decoded whole body."""
    text = body.decode("utf-8", "replace").removeprefix("\ufeff")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")[:-1]
    events: list[Event] = []
    data, event_type, id_buffer, last_id = "", "", "", ""
    block_retry: int | None = None
    retry: int | None = None
    comments = 0
    for line in lines:
        if not line:
            last_id = id_buffer
            if data:
                events.append((event_type or "message", data[:-1], last_id, block_retry))
            data, event_type, block_retry = "", "", None
            continue
        if line[0] == ":":
            comments += 1
            continue
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            data += value + "\n"
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            id_buffer = value
        elif name == "retry" and value.isascii() and value.isdigit():
            block_retry = retry = int(value)
    return events, last_id, comments, retry


def cut(body: bytes, points: list[int]) -> list[bytes]:
    marks = [0, *sorted(p % (len(body) + 1) for p in points), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(marks)]


def run(module: Any, chunks: list[bytes], **limits: int) -> tuple[list[Event], Any]:
    decoder = module.SSEDecoder(**limits)
    events = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    return [(e.event, e.data, e.id, e.retry) for e in events], decoder


# Pieces that steer the decoder into each of its paths: the one-event fast paths, runs of
# one shape, CR / CRLF across cuts, a BOM, split UTF-8, comments, every field.
PIECES = [
    b"data: x\n\n",
    b'data: {"a":1}\n\n',
    b"event: e\ndata: y\n\n",
    b"event: \ndata: z\n\n",
    b"data: a\ndata: b\n\n",
    b"data",
    b"data:",
    b"data: ",
    b"event: ",
    b"event:e",
    b"id: 1",
    b"id:",
    b"id: \x00",
    b"retry: 300",
    b"retry:1x",
    b"retry: 99999999999999999999999",
    b": keep-alive",
    b":",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\r\r",
    b"\n\ndata: ",
    b"\n\nevent: ",
    b"\xef\xbb\xbf",
    b"\xef\xbb",
    b"\xe2\x82",
    b"\xac",
    "é€😀".encode(),
    b"\xff",
    b"\x00",
    b" ",
    b"x",
    b"[DONE]",
]
bodies = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from(PIECES), max_size=60).map(b"".join),
    st.lists(st.sampled_from(PIECES) | st.binary(max_size=6), max_size=40).map(b"".join),
)
points = st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=25)


each_build = pytest.mark.parametrize("build", list(BUILDS.values()), ids=list(BUILDS))


@each_build
@FUZZ
@given(body=bodies, cuts=points)
def test_any_cuts_give_the_events_of_the_whole_body(
    build: Any, body: bytes, cuts: list[int]
) -> None:
    whole, whole_decoder = run(build, [body])
    pieces, pieces_decoder = run(build, cut(body, cuts))
    events, last_id, comments, retry = oracle(body)

    assert pieces == whole == events
    for decoder in (whole_decoder, pieces_decoder):
        assert decoder.last_event_id == last_id
        assert decoder.comment_count == comments
        assert decoder.retry == retry
        assert decoder.bytes_fed == len(body)


@each_build
@FUZZ
@given(body=bodies)
def test_byte_by_byte_gives_the_events_of_the_whole_body(build: Any, body: bytes) -> None:
    single, decoder = run(build, [body[i : i + 1] for i in range(len(body))])

    assert single == oracle(body)[0]
    assert decoder.last_event_id == oracle(body)[1]


def outcome(module: Any, chunks: list[bytes], **limits: int) -> tuple[str, list[Event]]:
    """("ok", events) or ("error", events dispatched before it); nothing else may escape."""
    decoder = module.SSEDecoder(**limits)
    events: list[Any] = []
    try:
        for chunk in chunks:
            events += decoder.feed(chunk)
    except module.SSEDecodeError:
        # From then on every feed refuses, and closing is still quiet.
        with pytest.raises(module.SSEDecodeError):
            decoder.feed(b"data: more\n\n")
        assert decoder.close() == []
        return "error", [(e.event, e.data, e.id, e.retry) for e in events]
    events += decoder.close()
    return "ok", [(e.event, e.data, e.id, e.retry) for e in events]


@each_build
@FUZZ
@given(
    body=bodies,
    cuts=points,
    max_line=st.integers(min_value=1, max_value=48),
    max_event=st.integers(min_value=1, max_value=48),
)
def test_limits_are_met_the_same_whatever_the_cuts(
    build: Any, body: bytes, cuts: list[int], max_line: int, max_event: int
) -> None:
    limits = {"max_line_bytes": max_line, "max_event_bytes": max_event}
    whole = outcome(build, [body], **limits)
    pieces = outcome(build, cut(body, cuts), **limits)
    events = oracle(body)[0]

    assert pieces[0] == whole[0]
    if whole[0] == "ok":
        assert pieces[1] == whole[1] == events
        assert all(len(data.encode()) <= max_event for _, data, _, _ in events)
    else:
        # What was dispatched before the error is what the algorithm dispatches first.
        assert pieces[1] == events[: len(pieces[1])]
        assert whole[1] == events[: len(whole[1])]


@each_build
@FUZZ
@given(body=st.binary(max_size=2000), cuts=points)
def test_random_bytes_raise_nothing_with_default_limits(
    build: Any, body: bytes, cuts: list[int]
) -> None:
    events, _ = run(build, cut(body, cuts))

    assert events == oracle(body)[0]
