"""What a streamed LLM response said about itself: format, end, errors, usage and text.

``analyze`` reads a whole ``text/event-stream`` body; ``StreamMeter`` reads one while
it is produced, a chunk at a time (MeteringMiddleware tees every body byte into one). Both give
a ``StreamReport``. Supported wire formats: OpenAI Chat Completions (and the servers that
speak it), OpenAI Responses, Anthropic Messages and Google Gemini; the format is detected from
the first events unless it is given.

    report = analyze(body)
    if not report.terminal_marker_seen:
        ...  # the stream was cut off: do not store it as a complete answer
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any

import msgspec

from ._llm_stream import StreamMeter, StreamReport

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "StreamMeter",
    "StreamReport",
    "analyze",
    "is_llm_json",
    "openai_tokenizer",
]


def openai_tokenizer(model: str = "gpt-4o") -> Callable[[str], int]:
    """An exact count for OpenAI models (``o200k_base``, ``cl100k_base``), offline: the
    encodings ship inside ``bpe-openai`` (``pip install 'asgi-disconnect[tokens]'``), so
    nothing is downloaded at run time. Pass it as ``tokenizer=``."""
    with warnings.catch_warnings():
        # bpe-openai 0.1 reads its encodings with a deprecated importlib.resources call.
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import bpe_openai
        except ImportError:
            raise ImportError(
                "openai_tokenizer needs bpe-openai: pip install 'asgi-disconnect[tokens]'"
            ) from None
        encoding = bpe_openai.encoding_for_model(model)

    def count(text: str) -> int:
        return len(encoding.encode(text)) if text else 0

    return count


class _Shape(msgspec.Struct):
    object: Any = None
    type: Any = None
    choices: Any = msgspec.UNSET
    candidates: Any = msgspec.UNSET
    usage: Any = msgspec.UNSET
    usageMetadata: Any = msgspec.UNSET
    error: Any = None


_SHAPE = msgspec.json.Decoder(_Shape)
_LLM_OBJECTS = frozenset({"chat.completion", "response", "text_completion"})
# What marks an LLM API's JSON when the body is too large or not whole yet (an embeddings
# batch names its rows before its usage, at the end).
_LLM_HINTS = (
    b'"choices"',
    b'"candidates"',
    b'"object":"embedding"',
    b'"object": "embedding"',
)
# A usage of token counts, seen in a body's first part: its first member a count of tokens.
_USAGE_HINT = re.compile(rb'"usage(?:Metadata)?"\s*:\s*\{\s*"\w*(?:_tokens|TokenCount)"\s*:\s*\d')
_WHOLE_JSON = 1 << 20


def is_llm_json(body: bytes, status: int, *, whole: bool = True) -> bool:
    """Whether a JSON response body is an LLM API's: an OpenAI, Anthropic or Gemini answer
    (its ``object`` / ``type``, ``choices``, ``candidates``, a ``usage``), or, with an error
    ``status``, a provider's error object. ``whole=False``: the first part of a body streamed
    in pieces, judged by what it shows (``choices``, ``usage``, embeddings' rows...)."""
    if not whole or len(body) > _WHOLE_JSON:
        head = body[:65536]
        return (
            any(hint in head for hint in _LLM_HINTS)
            or b'"chat.completion"' in head
            or _USAGE_HINT.search(head) is not None
        )
    try:
        shape = _SHAPE.decode(body)
    except msgspec.DecodeError:
        return False
    return llm_shape(shape, status)


def llm_shape(shape: Any, status: int | None) -> bool:
    """The rule, on a decoded body's members (``object``, ``type``, ``choices``,
    ``candidates``, ``usage``, ``usageMetadata``, ``error``; absent ones ``msgspec.UNSET``):
    what makes a JSON body an LLM API's, for generations and usage records alike."""
    unset = msgspec.UNSET
    if shape.object in _LLM_OBJECTS or shape.type == "message":
        return True
    if shape.choices is not unset or shape.candidates is not unset:
        return True
    if _token_counts(shape.usage) or _token_counts(shape.usageMetadata):
        return True
    # A provider's refusal passed on: its error object under an error status.
    error = shape.error
    return (
        (status or 0) >= 400
        and isinstance(error, dict)
        and any(name in error for name in ("type", "message", "status", "code"))
    )


def _token_counts(usage: Any) -> bool:
    """A ``usage`` an LLM API writes: an object with a count of tokens (``prompt_tokens``,
    ``input_tokens``, Gemini's ``promptTokenCount``...), not an app's own ``usage``."""
    return isinstance(usage, dict) and any(
        (name.endswith(("_tokens", "TokenCount")) and type(value) is int)
        for name, value in usage.items()
    )


def analyze(body: bytes, provider: str | None = None) -> StreamReport:
    """Analyze a whole ``text/event-stream`` body; ``provider`` as for ``StreamMeter``."""
    meter = StreamMeter(provider)
    meter.feed(body)
    return meter.report()
