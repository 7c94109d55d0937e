"""A generation's log read back as the demo's page shows it, without JavaScript: the text of
the events that ended, where a reader goes on from, and how the generation ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asgi_disconnect import GenerationInfo, Status
from asgi_disconnect.demo._answer import read_answer
from asgi_disconnect.metering import analyze

RECORDED = (Path(__file__).parents[1] / "data" / "openai_chat_basic.sse").read_bytes()


def info(status: Status, size: int) -> GenerationInfo:
    return GenerationInfo(
        id="gen_" + "a" * 24,
        status=status,
        policy="detach",
        size=size,
        status_code=200,
        content_type="text/event-stream",
        created_at=0.0,
        finished_at=None if status is Status.RUNNING else 1.0,
        detached=True,
        error=None,
    )


def text_of(body: bytes) -> str:
    pieces = []
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


def test_a_complete_recorded_answer_is_done_with_all_its_text() -> None:
    answer = read_answer(info(Status.COMPLETE, len(RECORDED)), RECORDED)
    assert analyze(RECORDED).terminal_marker_seen
    assert (answer.state, answer.message) == ("done", "Done.")
    assert answer.text == text_of(RECORDED)
    assert answer.offset == len(RECORDED)


def test_a_running_answer_shows_only_whole_events_and_says_where_to_read_on() -> None:
    cut = RECORDED.index(b"data: ", RECORDED.index(b'"content":"I\'m"')) + 20  # mid-event
    answer = read_answer(info(Status.RUNNING, cut), RECORDED[:cut])
    assert answer.state == "streaming"
    assert answer.text == "I'm"
    assert RECORDED[: answer.offset].endswith(b"\n\n")
    assert answer.offset < cut


def test_a_running_answer_before_its_first_token_is_waiting() -> None:
    preamble = RECORDED[: RECORDED.index(b"\n\n") + 2]  # the role chunk, no text
    answer = read_answer(info(Status.RUNNING, len(preamble)), preamble)
    assert (answer.state, answer.message) == ("waiting", "Waiting for the first token…")
    assert answer.text == ""


def frame(error: dict[str, str], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps({"error": error}) + "\n\n").encode()


@pytest.mark.parametrize(
    ("status", "tail", "message"),
    [
        (
            Status.CANCELLED,
            frame({"type": "cancelled", "message": "stopped by its owner"}, "error"),
            "Stopped.",
        ),
        (
            Status.FAILED,
            frame({"type": "server_error", "message": "The server had an error."}),
            "The server had an error. (server_error)",
        ),
        (Status.CANCELLED, b"", "Cancelled: its client left and the policy cancelled it."),
        (
            Status.INTERRUPTED,
            b"",
            "Interrupted: the server stopped before the answer was complete.",
        ),
        (Status.FAILED, b"", "The answer ended before it was complete."),
    ],
)
def test_an_answer_that_did_not_complete_says_why(
    status: Status, tail: bytes, message: str
) -> None:
    head = RECORDED[: RECORDED.index(b"\n\n", RECORDED.index(b'"content":"I\'m"')) + 2]
    body = head + tail
    answer = read_answer(info(status, len(body)), body)
    assert (answer.state, answer.message) == ("failed", message)
    assert answer.text == "I'm"
