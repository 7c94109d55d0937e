"""A generation's log (an OpenAI Chat Completions event stream, as the demo's routes relay
it) read back as the page shows it: the answer's text, and how it ended."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .. import GenerationInfo, Status
from ..sse import SSEDecoder

__all__ = ["STREAMING", "WAITING", "Answer", "delta", "error_message", "read_answer"]

WAITING = "Waiting for the first token…"
STREAMING = "Streaming…"

_LINE_END = re.compile(rb"\r\n|\r|\n")
# The message of the error frame a Stop writes (POST /generations/{id}/cancel).
_STOPPED = "stopped by its owner"
_ENDED = {
    Status.CANCELLED: "Cancelled: its client left and the policy cancelled it.",
    Status.INTERRUPTED: "Interrupted: the server stopped before the answer was complete.",
    Status.FAILED: "The answer ended before it was complete.",
}


@dataclass(frozen=True)
class Answer:
    text: str
    state: str  # waiting, streaming, done or failed
    message: str
    offset: int  # where the last whole event read ends: a reader goes on from there


def _whole_events(data: bytes) -> int:
    """Where the last whole event of ``data`` (an event stream from its start) ends."""
    end = 0
    line_start = 0
    for match in _LINE_END.finditer(data):
        if match.start() == line_start:
            end = match.end()
        line_start = match.end()
    return end


def error_message(payload: str) -> str | None:
    """What the page says of an error frame: ``event: error``, or a provider's data
    ``{"error": ...}``; None for a payload that is no error."""
    try:
        decoded = json.loads(payload)
    except ValueError:
        return None
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if not isinstance(error, dict):
        return None
    if error.get("type") == "cancelled" and error.get("message") == _STOPPED:
        return "Stopped."
    message = error.get("message") or "The stream failed."
    return f"{message} ({error['type']})" if error.get("type") else str(message)


def delta(data: str) -> str:
    """The text of one Chat Completions chunk."""
    try:
        payload: Any = json.loads(data)
    except ValueError:
        return ""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return ""
    change = choices[0].get("delta") or {}
    content = change.get("content") if isinstance(change, dict) else None
    return content if isinstance(content, str) else ""


def read_answer(info: GenerationInfo, data: bytes) -> Answer:
    """The answer in the first ``info.size`` bytes of its log, ``data``."""
    offset = _whole_events(data)
    pieces: list[str] = []
    done = False
    failure = None
    for event in SSEDecoder().feed(data[:offset]):
        if event.data == "[DONE]":
            done = True
            continue
        error = error_message(event.data)
        if error is not None or event.event == "error":
            failure = failure or error or event.data
        else:
            pieces.append(delta(event.data))
    text = "".join(pieces)
    if info.status is Status.RUNNING:
        state, message = ("streaming", STREAMING) if text else ("waiting", WAITING)
    elif done and failure is None:
        state, message = "done", "Done."
    else:
        state = "failed"
        message = failure or _ENDED.get(info.status, _ENDED[Status.FAILED])
    return Answer(text, state, message, offset)
