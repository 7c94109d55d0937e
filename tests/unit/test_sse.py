"""SSEDecoder: the WHATWG event-stream rules one by one, limits, and any chunking.

Every test runs against the installed decoder (compiled by mypyc where the build could) and
against ``sse.py`` run as plain Python, which is what an install without a compiler gets.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_disconnect import sse
from asgi_disconnect.sse import ServerSentEvent, SSEDecodeError, SSEDecoder

DATA = Path(__file__).resolve().parent.parent / "data"
VECTORS = sorted(path.name for path in DATA.glob("*.sse"))
SOURCE = Path(sse.__file__).with_name("sse.py")
COMPILED = not sse.__file__.endswith(".py")


def _run_from_source() -> object:
    name = "asgi_disconnect._sse_as_python"
    spec = importlib.util.spec_from_file_location(name, SOURCE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec resolves the event's annotations through it
    spec.loader.exec_module(module)
    return module


IMPLEMENTATIONS = {"compiled": sse, "python": _run_from_source()} if COMPILED else {"python": sse}


@pytest.fixture(scope="module", autouse=True, params=list(IMPLEMENTATIONS))
def implementation(request: pytest.FixtureRequest) -> object:
    """Point this module's names at one implementation for the tests that follow."""
    module = IMPLEMENTATIONS[request.param]
    names = ("sse", "SSEDecoder", "ServerSentEvent", "SSEDecodeError")
    saved = {name: globals()[name] for name in names}
    globals().update(
        sse=module,
        SSEDecoder=module.SSEDecoder,  # type: ignore[attr-defined]
        ServerSentEvent=module.ServerSentEvent,  # type: ignore[attr-defined]
        SSEDecodeError=module.SSEDecodeError,  # type: ignore[attr-defined]
    )
    yield module
    globals().update(saved)


def test_ci_tests_the_compiled_decoder() -> None:
    # CI builds the package the way a user's pip does; a build that fell back to pure Python
    # there would leave the compiled decoder untested.
    if os.environ.get("CI"):
        assert COMPILED, f"the decoder was not compiled: {sse.__file__}"


@pytest.mark.skipif(
    not (COMPILED and (SOURCE.parent.parent / ".git").exists()),
    reason="no compiled decoder in a source checkout",
)
def test_the_compiled_decoder_is_not_older_than_its_source() -> None:
    # An editable install imports the extension beside sse.py, even after sse.py changed.
    assert Path(sse.__file__).stat().st_mtime >= SOURCE.stat().st_mtime, (
        "asgi_disconnect/sse.py changed after it was compiled: run `pip install -e .` again"
    )


Event = tuple[str, str, str, int | None]


def decode(*chunks: bytes, **limits: int) -> list[ServerSentEvent]:
    decoder = SSEDecoder(**limits)
    events = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    return events


def datas(*chunks: bytes) -> list[str]:
    return [event.data for event in decode(*chunks)]


def reference(body: bytes) -> tuple[list[Event], int, str]:
    """The spec's algorithm, literally: decode the whole stream, split lines, interpret."""
    text = body.decode("utf-8", "replace")
    text = text.removeprefix("\ufeff")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")[:-1]
    events: list[Event] = []
    data, event_type, id_buffer, last_id, retry, comments = "", "", "", "", None, 0
    for line in lines:
        if not line:
            last_id = id_buffer
            if data:
                events.append((event_type or "message", data.removesuffix("\n"), last_id, retry))
            data, event_type, retry = "", "", None
            continue
        if line.startswith(":"):
            comments += 1
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data += value + "\n"
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            id_buffer = value
        elif name == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return events, comments, last_id


def as_tuples(events: list[ServerSentEvent]) -> list[Event]:
    return [(event.event, event.data, event.id, event.retry) for event in events]


def feed_repeatedly(decoder: SSEDecoder, chunk: bytes, times: int) -> None:
    for _ in range(times):
        decoder.feed(chunk)


def split_at(body: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cut % (len(body) + 1) for cut in cuts), len(body)]
    return [body[start:end] for start, end in itertools.pairwise(points)]


# The byte order mark.


def test_bom_at_the_start_is_stripped() -> None:
    assert datas(b"\xef\xbb\xbfdata: x\n\n") == ["x"]


def test_bom_split_across_chunks_is_stripped() -> None:
    assert datas(b"\xef", b"\xbb", b"\xbfdata: x\n\n") == ["x"]
    assert datas(b"\xef\xbb", b"\xbf", b"data: x\n\n") == ["x"]


def test_only_the_first_bom_is_stripped() -> None:
    # A second BOM belongs to the first line's field name, which is then unknown.
    assert datas(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n") == []
    assert datas(b"data: a\n\n\xef\xbb\xbfdata: b\n\n") == ["a"]


def test_bytes_that_only_start_like_a_bom_are_data() -> None:
    assert datas(b"\xef\xbb", b"x\ndata: y\n\n") == ["y"]
    assert datas(b"data: \xef\xbb\xbf\n\n") == ["\ufeff"]


# Line ends.


@pytest.mark.parametrize("end", [b"\n", b"\r", b"\r\n"], ids=["LF", "CR", "CRLF"])
def test_every_line_end_works(end: bytes) -> None:
    body = b"event: e" + end + b"data: a" + end + b"data: b" + end + end + b"data: c" + end + end
    assert [(e.event, e.data) for e in decode(body)] == [("e", "a\nb"), ("message", "c")]


def test_mixed_line_ends() -> None:
    assert datas(b"data: a\rdata: b\ndata: c\r\n\r\ndata: d\n\r") == ["a\nb\nc", "d"]


def test_cr_at_the_end_of_a_chunk_and_lf_at_the_start_of_the_next_are_one_line_end() -> None:
    assert datas(b"data: a\r", b"\ndata: b\r\n\r\n") == ["a\nb"]
    assert datas(b"data: a\r\n\r", b"\n") == ["a"]


def test_lf_after_a_chunk_ending_in_cr_is_dropped_only_once() -> None:
    assert datas(b"data: a\r", b"\n\n") == ["a"]
    assert datas(b"data: a\r", b"", b"\n", b"\ndata: b\n\n") == ["a", "b"]


def test_a_lone_cr_at_a_chunk_end_is_a_line_end() -> None:
    assert datas(b"data: a\r", b"data: b\r", b"\r") == ["a\nb"]


# Comments, fields and values.


def test_comment_lines_are_counted_and_ignored() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b": OPENROUTER PROCESSING\n\n:\n: x\ndata: a\n\n")
    assert [event.data for event in events] == ["a"]
    assert decoder.comment_count == 3


def test_a_complete_comment_line_counts_before_its_event_ends() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n: keep-") == []
    assert decoder.comment_count == 0
    assert decoder.feed(b"alive\n") == []
    assert decoder.comment_count == 1
    decoder.feed(b"\n")
    assert decoder.comment_count == 1


def test_a_colon_later_in_a_line_is_not_a_comment() -> None:
    decoder = SSEDecoder()
    assert [e.data for e in decoder.feed(b"data: :not a comment\n\n")] == [":not a comment"]
    assert decoder.comment_count == 0


def test_data_lines_are_joined_with_lf() -> None:
    assert datas(b"data: a\ndata: b\ndata: c\n\n") == ["a\nb\nc"]


def test_only_one_trailing_lf_is_removed_from_data() -> None:
    assert datas(b"data: a\ndata:\n\n") == ["a\n"]
    assert datas(b"data\ndata\n\n") == ["\n"]


def test_only_one_leading_space_is_stripped() -> None:
    assert datas(b"data:  two\n\n") == [" two"]
    assert datas(b"data:none\n\n") == ["none"]
    assert datas(b"data: a: b\n\n") == ["a: b"]


def test_a_line_without_colon_is_a_field_with_an_empty_value() -> None:
    assert datas(b"data\n\n") == [""]
    assert [e.event for e in decode(b"event: x\nevent\ndata: a\n\n")] == ["message"]


def test_empty_data_is_an_event_but_no_data_is_not() -> None:
    assert datas(b"data:\n\n") == [""]
    assert datas(b"event: x\n\nid: 1\n\n") == []


def test_event_sets_the_type_for_one_event() -> None:
    events = decode(b"event: delta\ndata: 1\n\ndata: 2\n\nevent:\ndata: 3\n\n")
    assert [(e.event, e.data) for e in events] == [
        ("delta", "1"),
        ("message", "2"),
        ("message", "3"),
    ]


def test_a_block_without_data_resets_the_event_type() -> None:
    events = decode(b"event: lost\n\ndata: 1\n\n")
    assert [(e.event, e.data) for e in events] == [("message", "1")]


def test_one_chunk_of_many_blocks_of_every_shape_is_parsed_like_the_reference() -> None:
    # Blocks of several shapes in one chunk: how the runs hand over must not nest deeper
    # with the number of blocks.
    shapes = [
        b"data: a\n\n",
        b"event: e\ndata: b\n\n",
        b": keep-alive\n\n",
        b"id: 7\ndata: c\n\n",
        b"\n",
        b"data: d\ndata: e\n\n",
    ]
    body = b"".join(shapes[i % len(shapes)] for i in range(30_000))
    events, comments, last_id = reference(body)
    decoder = SSEDecoder()
    assert as_tuples(decoder.feed(body)) == events
    assert decoder.comment_count == comments
    assert decoder.last_event_id == last_id


@pytest.mark.parametrize("chunks", [1, 2], ids=["whole", "per block"])
def test_an_event_name_that_looks_like_a_data_line_is_a_name(chunks: int) -> None:
    blocks = [b"event: a\ndata: 1\n\n", b"event: data: 2\n\n", b"event: b\ndata: 3\n\n"]
    body = b"".join(blocks)
    events = decode(body) if chunks == 1 else decode(*blocks)
    assert [(e.event, e.data) for e in events] == [("a", "1"), ("b", "3")]


def test_unknown_fields_are_ignored() -> None:
    assert datas(b"foo: bar\nData: x\ndata: a\nDATA: y\n\n") == ["a"]


# id and retry.


def test_the_last_event_id_persists_across_events() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"id: 7\ndata: a\n\ndata: b\n\nid: 8\ndata: c\n\n")
    assert [(e.data, e.id) for e in events] == [("a", "7"), ("b", "7"), ("c", "8")]
    assert decoder.last_event_id == "8"


def test_an_empty_id_resets_the_last_event_id() -> None:
    events = decode(b"id: 7\ndata: a\n\nid\ndata: b\n\nid: 9\ndata: c\n\nid:\ndata: d\n\n")
    assert [e.id for e in events] == ["7", "", "9", ""]


def test_an_id_with_nul_is_ignored() -> None:
    events = decode(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n")
    assert [e.id for e in events] == ["1", "1"]


def test_an_id_without_data_still_sets_the_last_event_id() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"id: 5\n\n") == []
    assert decoder.last_event_id == "5"
    assert decoder.feed(b"data: a\n\n")[0].id == "5"


def test_the_last_event_id_changes_only_when_its_event_ends() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"id: 1\ndata: a\n\nid: 2\ndata: b\n")
    assert decoder.last_event_id == "1"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"1500", 1500),
        (b"0", 0),
        (b"007", 7),
        (b"15a", None),
        (b"-1", None),
        (b"1.5", None),
        (b" 1", None),
        (b"", None),
        ("١٢".encode(), None),
        (b"9" * 5000, None),
    ],
)
def test_retry_is_taken_only_when_all_ascii_digits(value: bytes, expected: int | None) -> None:
    decoder = SSEDecoder()
    [event] = decoder.feed(b"retry: " + value + b"\ndata: a\n\n")
    assert event.retry == expected
    assert decoder.retry == expected


def test_retry_sets_the_reconnection_time_for_later_events_only_in_its_block() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"retry: 10\ndata: a\n\ndata: b\n\nretry: x\n\n")
    assert [e.retry for e in events] == [10, None]
    assert decoder.retry == 10


def test_retry_takes_effect_as_soon_as_its_line_ends() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"retry: 3000\ndata: a")
    assert decoder.retry == 3000
    decoder.close()
    assert decoder.retry == 3000


# End of stream and UTF-8.


def test_an_event_cut_off_by_the_end_of_the_stream_is_not_dispatched() -> None:
    decoder = SSEDecoder()
    assert [e.data for e in decoder.feed(b"data: a\n\ndata: b\n")] == ["a"]
    assert decoder.close() == []
    assert datas(b"data: a") == []
    assert datas(b"data: a\n") == []


def test_invalid_utf8_is_replaced_never_raised() -> None:
    events = decode(b"event: \xff\ndata: \xc3\x28 ok \xed\xa0\x80\nid: \xfe\n\n")
    assert events == [
        ServerSentEvent(event="\ufffd", data="\ufffd( ok \ufffd\ufffd\ufffd", id="\ufffd")
    ]


@pytest.mark.parametrize("text", ["€", "東京", "🚀", "é"])
def test_a_character_split_across_chunks_is_decoded_whole(text: str) -> None:
    body = f"data: {text}\n\nevent: {text}\ndata: x\n\n".encode()
    for cut in range(len(body) + 1):
        events = decode(body[:cut], body[cut:])
        assert [(e.event, e.data) for e in events] == [("message", text), (text, "x")]


@pytest.mark.parametrize("size", [64, 4096, 200_000])
def test_an_event_of_many_lines_is_parsed_while_it_arrives(size: int) -> None:
    lines = [f"{n:05} " + "x" * 90 for n in range(1000)]
    body = b"event: big\n" + "".join(f"data: {line}\n" for line in lines).encode()
    chunks = [body[start : start + size] for start in range(0, len(body), size)]
    events = decode(*chunks, b"\n", b"data: next\n\n")
    assert [(e.event, e.data) for e in events] == [("big", "\n".join(lines)), ("message", "next")]


def test_bytes_fed_counts_every_byte_given() -> None:
    decoder = SSEDecoder()
    for chunk in (b"\xef\xbb", b"\xbfdata: a\r", b"\n\r\n", b"", b"data: b"):
        decoder.feed(chunk)
    assert decoder.bytes_fed == 21


# Limits.


def test_a_line_longer_than_the_limit_raises() -> None:
    assert datas(b"data: 1234\n\n") == ["1234"]
    with pytest.raises(SSEDecodeError):
        decode(b"data: 12345\n\n", max_line_bytes=10)
    assert decode(b"data: 1234\n\n", max_line_bytes=10)[0].data == "1234"


def test_an_overlong_line_between_short_ones_raises() -> None:
    with pytest.raises(SSEDecodeError):
        decode(b"data: a\ndata: " + b"x" * 20 + b"\ndata: b\n\n", max_line_bytes=10)


def test_a_line_growing_past_the_limit_raises_before_it_ends() -> None:
    decoder = SSEDecoder(max_line_bytes=100)
    decoder.feed(b"data: ")
    feed_repeatedly(decoder, b"x" * 7, 13)
    with pytest.raises(SSEDecodeError):
        decoder.feed(b"x" * 7)


def test_an_event_larger_than_the_limit_raises() -> None:
    assert decode(b"data: 12345\ndata: 1234\n\n", max_event_bytes=10)[0].data == "12345\n1234"
    with pytest.raises(SSEDecodeError):
        decode(b"data: 12345\ndata: 12345\n\n", max_event_bytes=10)
    with pytest.raises(SSEDecodeError):
        decode(b"data: 12345678901\n\n", max_event_bytes=10)


def test_the_event_limit_counts_utf8_bytes() -> None:
    assert decode("data: €€€\n\n".encode(), max_event_bytes=9)[0].data == "€€€"
    with pytest.raises(SSEDecodeError):
        decode("data: €€€€\n\n".encode(), max_event_bytes=9)


def test_the_decoder_refuses_input_after_an_error() -> None:
    decoder = SSEDecoder(max_line_bytes=4)
    with pytest.raises(SSEDecodeError):
        decoder.feed(b"data: abc\n\n")
    with pytest.raises(SSEDecodeError):
        decoder.feed(b"data: a\n\n")


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(SSEDecodeError, ValueError)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        SSEDecoder(max_line_bytes=0)


def peak_memory(feed: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        feed()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_stays_bounded_on_endless_comments_and_fields() -> None:
    decoder = SSEDecoder()
    chunk = b": keep-alive\nevent: x\nid: 1\n" * 150

    assert peak_memory(lambda: feed_repeatedly(decoder, chunk, 500)) < 1 << 20
    assert decoder.comment_count == 75_000


def test_memory_stays_bounded_until_an_overlong_event_raises() -> None:
    decoder = SSEDecoder(max_event_bytes=1 << 18)
    chunk = b"data: x\n" * 512

    def feed() -> None:
        with pytest.raises(SSEDecodeError):
            feed_repeatedly(decoder, chunk, 1000)

    assert peak_memory(feed) < 1 << 20


def test_memory_stays_bounded_until_an_overlong_line_raises() -> None:
    decoder = SSEDecoder(max_line_bytes=1 << 20)

    def feed() -> None:
        decoder.feed(b"data: ")
        with pytest.raises(SSEDecodeError):
            feed_repeatedly(decoder, b"x" * 64, 100_000)

    assert peak_memory(feed) < 3 << 20


# Properties.

TOKENS = [
    b"data",
    b"data:",
    b"data: ",
    b"event: e",
    b"event:",
    b"id: 7",
    b"id:\x00",
    b"retry: 12",
    b"retry: 1a",
    b":c",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"x",
    b" ",
    b":",
    "€".encode(),
    b"\xe2",
    b"\xef\xbb\xbf",
    b"\n\ndata: ",
    b"\n\nevent: ",
]
streams = st.lists(st.sampled_from(TOKENS), max_size=40).map(b"".join)
cuts = st.lists(st.integers(min_value=0, max_value=10_000), max_size=20)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(VECTORS), cut_points=cuts)
def test_any_chunking_of_a_vector_gives_the_same_events(name: str, cut_points: list[int]) -> None:
    body = (DATA / name).read_bytes()
    whole = SSEDecoder()
    expected = whole.feed(body)
    chunked = SSEDecoder()
    events = []
    for chunk in split_at(body, cut_points):
        events += chunked.feed(chunk)
    assert events == expected
    assert chunked.comment_count == whole.comment_count
    assert chunked.last_event_id == whole.last_event_id


@settings(max_examples=200, deadline=None)
@given(body=streams, cut_points=cuts)
def test_any_chunking_follows_the_reference_algorithm(body: bytes, cut_points: list[int]) -> None:
    events, comments, last_id = reference(body)
    decoder = SSEDecoder()
    got = []
    for chunk in split_at(body, cut_points):
        got += decoder.feed(chunk)
    assert as_tuples(got) == events
    assert decoder.comment_count == comments
    assert decoder.last_event_id == last_id


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=400) | streams,
    cut_points=cuts,
    max_line=st.integers(min_value=1, max_value=64),
    max_event=st.integers(min_value=1, max_value=64),
)
def test_random_bytes_raise_nothing_but_decode_errors(
    body: bytes, cut_points: list[int], max_line: int, max_event: int
) -> None:
    decoder = SSEDecoder(max_line_bytes=max_line, max_event_bytes=max_event)
    try:
        for chunk in split_at(body, cut_points):
            for event in decoder.feed(chunk):
                assert len(event.data.encode()) <= max_event
        decoder.close()
    except SSEDecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    body=streams,
    cut_points=cuts,
    tail_cap=st.integers(min_value=0, max_value=40),
    slice_size=st.integers(min_value=1, max_value=16),
)
def test_tiny_internal_buffers_follow_the_reference_algorithm(
    body: bytes, cut_points: list[int], tail_cap: int, slice_size: int
) -> None:
    # Shrinking the buffers drives every chunk through the overflow and slicing paths.
    with (
        mock.patch.object(sse, "_TAIL_CAP", tail_cap),
        mock.patch.object(sse, "_SLICE", slice_size),
    ):
        decoder = SSEDecoder()
        got = []
        for chunk in split_at(body, cut_points):
            got += decoder.feed(chunk)
    events, comments, last_id = reference(body)
    assert as_tuples(got) == events
    assert decoder.comment_count == comments
    assert decoder.last_event_id == last_id
