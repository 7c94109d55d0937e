"""How another replica finishes a detached generation: what the relay records, the upstream
call that produces the rest of the answer, and the stitching of that call's events onto the
stored ones, so that readers see one stream with one terminal marker.

No I/O here. The stored bytes are provider events exactly as relayed, whole events only
(``open_stream`` relays whole events when it records a continuation).

- ``responses`` (OpenAI Responses in background mode): ``GET {url}/{id}?stream=true&
  starting_after=N`` with the response id of the stored ``response.created`` and the last
  stored ``sequence_number``: the provider's own events from N + 1, byte for byte, no second
  bill.
- ``continue_final_message`` (vLLM, SGLang): the request again with the stored text as a final
  assistant message, ``continue_final_message: true``, ``add_generation_prompt: false``; the
  continuation's chunks take the stored stream's id, its role-only first chunk is dropped.
- ``prefill`` (Anthropic Messages): the stored text, without its trailing whitespace (the API
  refuses it), as a final assistant message; the continuation's ``message_start`` is dropped,
  its first block continues the stored open block, and the whitespace taken off is taken off
  the front of its first text.
- ``synthetic`` (where prefill is refused, if the route chose it): the stored text as the
  assistant's turn and a user turn asking to go on from its last word; stitched as prefill,
  not byte-exact.
- ``restart``: the request again from the start, after an ``asgi_disconnect.restart`` event
  that tells readers the output before it is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgspec

__all__ = [
    "FALLBACKS",
    "KINDS",
    "RESTART_EVENT",
    "Attempt",
    "Continuation",
    "Stitcher",
    "background_body",
    "decode",
    "encode",
    "plan",
    "recorded",
    "response_url",
]

KINDS = ("responses", "continue_final_message", "prefill", "restart")
FALLBACKS = ("synthetic", "restart", "interrupted")
# The event a restart begins with: readers drop what they had of the earlier output.
RESTART_EVENT = "asgi_disconnect.restart"
# The only request headers a continuation keeps: never a credential.
_KEPT_HEADERS = frozenset(
    {"content-type", "accept", "anthropic-version", "anthropic-beta", "openai-beta"}
)
_SYNTHETIC_ASK = (
    "Your previous answer was cut off. Continue it exactly from its last word, without "
    "repeating anything and without any preamble."
)


class Continuation(msgspec.Struct, frozen=True, kw_only=True):
    """What a generation records so that another replica can finish it: the upstream call
    (never its credentials) and how to continue it. ``upstream`` names the client each
    replica registers (``install(upstreams={name: client})``)."""

    kind: str
    upstream: str
    method: str
    url: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    fallback: str = "interrupted"
    # The first attempt's W3C ``traceparent``: the attempts after it link their spans to it.
    trace: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"continuation must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(
                f"fallback must be one of {', '.join(FALLBACKS)}, not {self.fallback!r}"
            )
        if self.method.upper() != "POST":
            raise ValueError(f"a continuation replays a POST, not {self.method!r}")
        if not self.upstream:
            raise ValueError("a continuation needs the name of its upstream")
        _json_object(self.body)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Continuation)


def encode(continuation: Continuation) -> bytes:
    return _ENCODER.encode(continuation)


def decode(data: bytes) -> Continuation:
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"a stored continuation cannot be read: {exc}") from None


def recorded(
    kind: str,
    *,
    upstream: str,
    method: str,
    url: str,
    body: bytes,
    headers: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    fallback: str = "interrupted",
    trace: str | None = None,
) -> Continuation:
    """The continuation of a relay: only allow-listed headers are kept (a key never is)."""
    kept = tuple((k.lower(), v) for k, v in headers if k.lower() in _KEPT_HEADERS)
    if kind == "responses":
        body = background_body(body)
    return Continuation(
        kind=kind,
        upstream=upstream,
        method=method.upper(),
        url=url,
        body=body,
        headers=kept,
        fallback=fallback,
        trace=trace,
    )


def background_body(body: bytes) -> bytes:
    """An OpenAI Responses request body asking for background mode (which needs ``store``):
    the provider keeps generating and keeps the events for a re-attach."""
    payload = _json_object(body)
    payload.update(background=True, store=True, stream=True)
    return msgspec.json.encode(payload)


@dataclass(frozen=True)
class Attempt:
    """One upstream call that produces the rest of an answer, and how to stitch it."""

    kind: str
    method: str
    url: str
    body: bytes | None
    headers: tuple[tuple[str, str], ...]
    byte_exact: bool
    stitcher: Stitcher


def plan(continuation: Continuation, stored: bytes, *, refused: bool = False) -> Attempt | None:
    """The call that finishes the answer ``stored`` began, or None: it stays interrupted.
    ``refused``: the provider refused the kind's call (a model without prefill)."""
    kind = continuation.kind
    if refused or not _possible(kind, stored):
        kind = continuation.fallback
        if kind == "interrupted":
            return None
    if kind == "responses":
        return _reattach(continuation, stored)
    if kind == "continue_final_message":
        return _continue_final_message(continuation, stored)
    if kind in ("prefill", "synthetic"):
        return _prefill(continuation, stored, synthetic=kind == "synthetic")
    return _restart(continuation, stored)


def _possible(kind: str, stored: bytes) -> bool:
    if kind == "responses":
        return _responses_cursor(stored) is not None
    if kind == "prefill":
        return _anthropic_state(stored) is not None
    return True


# -- the stored events -------------------------------------------------------------------


def _frames(data: bytes) -> list[bytes]:
    """The whole events in ``data`` (blank-line terminated), without their blank line."""
    data = data.replace(b"\r\n", b"\n")
    return [frame for frame in data.split(b"\n\n")[:-1] if frame.strip()]


def _parsed(frame: bytes) -> tuple[str | None, bytes]:
    """An event's name and its data (lines joined)."""
    name = None
    data: list[bytes] = []
    for line in frame.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
        elif line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
    return name, b"\n".join(data)


def _json(data: bytes) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise ValueError("a continuation's request body must be JSON") from None
    if not isinstance(payload, dict):
        raise ValueError("a continuation's request body must be a JSON object")
    return payload


def _headers(continuation: Continuation) -> tuple[tuple[str, str], ...]:
    return continuation.headers


# -- responses: re-attach ----------------------------------------------------------------


def _responses_cursor(stored: bytes) -> tuple[str, int] | None:
    """The stored response id and last sequence number, if the stream began."""
    response_id = None
    last = -1
    for frame in _frames(stored):
        _, data = _parsed(frame)
        payload = _json(data)
        if not isinstance(payload, dict):
            continue
        response = payload.get("response")
        if response_id is None and isinstance(response, dict):
            found = response.get("id")
            response_id = found if isinstance(found, str) else None
        sequence = payload.get("sequence_number")
        if isinstance(sequence, int):
            last = max(last, sequence)
    return None if response_id is None else (response_id, last)


def response_url(create_url: str, response_id: str, suffix: str = "", **query: Any) -> str:
    """The URL of one response, from the URL that created it: ``{path}/{id}{suffix}``, its
    query kept (Azure's ``api-version``) and ``query`` added."""
    parts = urlsplit(create_url)
    path = f"{parts.path.rstrip('/')}/{response_id}{suffix}"
    extra = urlencode(query)
    merged = "&".join(q for q in (parts.query, extra) if q)
    return urlunsplit((parts.scheme, parts.netloc, path, merged, ""))


def _reattach(continuation: Continuation, stored: bytes) -> Attempt:
    cursor = _responses_cursor(stored)
    assert cursor is not None
    response_id, last = cursor
    url = response_url(continuation.url, response_id, stream="true", starting_after=last)
    return Attempt(
        kind="responses",
        method="GET",
        url=url,
        body=None,
        headers=tuple((k, v) for k, v in continuation.headers if k != "content-type"),
        byte_exact=True,
        stitcher=_ResponsesStitcher(last),
    )


# -- OpenAI-compatible chat: continue_final_message --------------------------------------


def _chat_state(stored: bytes) -> tuple[str | None, str]:
    """The stored stream's chunk id and its text so far."""
    chunk_id = None
    parts: list[str] = []
    for frame in _frames(stored):
        _, data = _parsed(frame)
        payload = _json(data)
        if not isinstance(payload, dict):
            continue
        if chunk_id is None and isinstance(payload.get("id"), str):
            chunk_id = payload["id"]
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                content = (choice.get("delta") or {}).get("content")
                if isinstance(content, str):
                    parts.append(content)
    return chunk_id, "".join(parts)


def _continue_final_message(continuation: Continuation, stored: bytes) -> Attempt:
    chunk_id, text = _chat_state(stored)
    payload = _json_object(continuation.body)
    payload["stream"] = True
    # The attempt's record needs the provider's usage: asked for, and kept from the readers
    # if the relay did not ask for it.
    options = payload.get("stream_options")
    asked = isinstance(options, dict) and options.get("include_usage") is True
    payload["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    if text:
        payload["messages"] = [
            *payload.get("messages", []),
            {"role": "assistant", "content": text},
        ]
        payload["continue_final_message"] = True
        payload["add_generation_prompt"] = False
    return Attempt(
        kind="continue_final_message",
        method="POST",
        url=continuation.url,
        body=msgspec.json.encode(payload),
        headers=_headers(continuation),
        byte_exact=False,
        stitcher=_ChatStitcher(chunk_id, drop_role=bool(text), hide_usage=not asked),
    )


# -- Anthropic Messages: prefill ---------------------------------------------------------


@dataclass
class _AnthropicState:
    text: str
    last_index: int  # the stored blocks' last index (-1: none)
    open: bool  # the last block has no content_block_stop


def _anthropic_state(stored: bytes) -> _AnthropicState | None:
    """The stored text and blocks, or None where prefill cannot continue them (a block that
    is not text: a tool call, a thinking block)."""
    parts: list[str] = []
    last_index = -1
    open_block = False
    for frame in _frames(stored):
        name, data = _parsed(frame)
        payload = _json(data)
        if not isinstance(payload, dict):
            continue
        kind = payload.get("type", name)
        if kind == "content_block_start":
            block = payload.get("content_block") or {}
            if block.get("type") != "text":
                return None
            last_index = int(payload.get("index", last_index + 1))
            open_block = True
            if isinstance(block.get("text"), str):
                parts.append(block["text"])
        elif kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") != "text_delta":
                return None
            parts.append(delta.get("text", ""))
        elif kind == "content_block_stop":
            open_block = False
    return _AnthropicState("".join(parts), last_index, open_block)


def _prefill(continuation: Continuation, stored: bytes, *, synthetic: bool) -> Attempt:
    state = _anthropic_state(stored) or _AnthropicState("", -1, False)
    prefill = state.text.rstrip()
    removed = state.text[len(prefill) :]
    payload = _json_object(continuation.body)
    payload["stream"] = True
    messages = list(payload.get("messages", []))
    if prefill and synthetic:
        messages += [
            {"role": "assistant", "content": prefill},
            {"role": "user", "content": _SYNTHETIC_ASK},
        ]
    elif prefill:
        messages.append({"role": "assistant", "content": prefill})
    payload["messages"] = messages
    return Attempt(
        kind="synthetic" if synthetic else "prefill",
        method="POST",
        url=continuation.url,
        body=msgspec.json.encode(payload),
        headers=_headers(continuation),
        byte_exact=False,
        stitcher=_AnthropicStitcher(state, removed if prefill else "", began=bool(stored)),
    )


# -- restart -----------------------------------------------------------------------------


def _restart(continuation: Continuation, stored: bytes) -> Attempt:
    return Attempt(
        kind="restart",
        method="POST",
        url=continuation.url,
        body=continuation.body,
        headers=_headers(continuation),
        byte_exact=False,
        stitcher=_RestartStitcher(len(stored)),
    )


# -- stitching ---------------------------------------------------------------------------


class Stitcher:
    """The continuation's raw bytes (any split) in, the bytes to append to the log out:
    whole events only, rewritten to continue the stored stream."""

    def __init__(self) -> None:
        self._pending = b""
        self.progressed = False  # an event that shows the answer under way came

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self._pending = data[end:]
        if not end:
            return b""
        out = [self.event(frame) for frame in _frames(data[:end])]
        return b"".join(event for event in out if event)

    def end(self) -> bytes:
        """What is left once the continuation ended; an event cut off is an error."""
        if self._pending.strip():
            raise ValueError(
                f"the continuation ended in the middle of an event ({len(self._pending)} bytes)"
            )
        return b""

    def event(self, frame: bytes) -> bytes:
        """One whole event of the continuation (without its blank line) as it is appended."""
        self.progressed = True
        return frame + b"\n\n"


class _ResponsesStitcher(Stitcher):
    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last

    def event(self, frame: bytes) -> bytes:
        name, data = _parsed(frame)
        payload = _json(data)
        if isinstance(payload, dict):
            sequence = payload.get("sequence_number")
            if isinstance(sequence, int) and sequence <= self.last:
                return b""  # stored already
            kind = payload.get("type", name)
            if kind not in ("response.queued", "response.created"):
                self.progressed = True
        return frame + b"\n\n"


class _ChatStitcher(Stitcher):
    def __init__(self, chunk_id: str | None, *, drop_role: bool, hide_usage: bool) -> None:
        super().__init__()
        self.chunk_id = chunk_id
        self.drop_role = drop_role
        self.hide_usage = hide_usage
        self.first = True

    def event(self, frame: bytes) -> bytes:
        self.progressed = True
        _, data = _parsed(frame)
        payload = _json(data)
        if not isinstance(payload, dict):
            return frame + b"\n\n"  # [DONE], or what the provider sent as it is
        first, self.first = self.first, False
        if first and self.drop_role and _role_only(payload):
            return b""
        changed = False
        if self.hide_usage and "usage" in payload:
            if not payload.get("choices") and payload["usage"]:
                return b""  # the usage chunk the relay did not ask for
            del payload["usage"]
            changed = True
        if self.chunk_id is not None and payload.get("id") != self.chunk_id:
            payload["id"] = self.chunk_id
            changed = True
        if changed:
            return b"data: " + msgspec.json.encode(payload) + b"\n\n"
        return frame + b"\n\n"


def _role_only(payload: dict[str, Any]) -> bool:
    choices = payload.get("choices") or []
    return bool(choices) and all(
        isinstance(choice, dict)
        and not (choice.get("delta") or {}).get("content")
        and not choice.get("finish_reason")
        for choice in choices
    )


class _AnthropicStitcher(Stitcher):
    def __init__(self, state: _AnthropicState, removed: str, *, began: bool) -> None:
        super().__init__()
        self.began = began  # the stored stream has its message_start
        self.removed = removed
        # The continuation's block 0 continues the stored open block; later ones follow.
        self.shift = state.last_index if state.open else state.last_index + 1
        self.joins_open = state.open
        self.first_text = True

    def event(self, frame: bytes) -> bytes:
        self.progressed = True
        name, data = _parsed(frame)
        payload = _json(data)
        if not isinstance(payload, dict):
            return frame + b"\n\n"
        kind = payload.get("type", name)
        if kind == "message_start" and self.began:
            return b""
        if kind == "ping" and self.began and self.first_text:
            return b""
        index = payload.get("index")
        if isinstance(index, int):
            if kind == "content_block_start" and index == 0 and self.joins_open:
                return b""
            payload["index"] = index + self.shift
        if kind == "content_block_delta" and self.first_text:
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.first_text = False
                text = delta.get("text", "")
                if self.removed and text.startswith(self.removed):
                    delta["text"] = text[len(self.removed) :]
                    if not delta["text"]:
                        return b""
        if not isinstance(index, int) or not isinstance(kind, str):
            return frame + b"\n\n"
        return _anthropic_event(kind, payload)


def _anthropic_event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


class _RestartStitcher(Stitcher):
    def __init__(self, replaced: int) -> None:
        super().__init__()
        self.replaced = replaced
        self.announced = False

    def event(self, frame: bytes) -> bytes:
        self.progressed = True
        head = b""
        if not self.announced:
            self.announced = True
            if self.replaced:
                notice = msgspec.json.encode({"replaces": self.replaced})
                head = b"event: " + RESTART_EVENT.encode() + b"\ndata: " + notice + b"\n\n"
        return head + frame + b"\n\n"
