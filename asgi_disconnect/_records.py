"""The records the stores keep and the middlewares exchange: plain data, no behaviour."""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "Adopted",
    "Claim",
    "ClaimState",
    "GenerationInfo",
    "Status",
    "StoredResponse",
    "UsageRecord",
]


class Status(enum.StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


class GenerationInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What ``GET {resume_prefix}/{id}`` reports about a generation.

    ``created_at`` and ``finished_at`` are Unix seconds by the producing process's clock,
    to the microsecond, the same whether read from the live log or from a database.
    ``attempt`` is 1 unless a replica took it over (then it counts the upstream calls);
    ``owner`` is the store's token of the process that produces it (the command line shows
    it; the endpoints do not).
    """

    id: str
    status: Status
    policy: str | None
    size: int
    status_code: int
    content_type: str | None
    created_at: float
    finished_at: float | None
    detached: bool
    error: str | None
    attempt: int = 1
    owner: str | None = None


class Adopted(msgspec.Struct, frozen=True, kw_only=True):
    """A detached generation this process took over from an owner whose lease lapsed (or
    who handed it over): the store's row as it was when the database chose this process.

    The row's owner is now this process's token, the fence every later write of an earlier
    owner is refused by; ``attempt`` counts the owners (the upstream calls) it had.
    ``size`` bytes are stored; the continuation appends from there."""

    id: str
    principal: str
    attempt: int
    size: int
    status_code: int
    content_type: str | None
    policy: str | None
    created_at: float
    continuation: bytes
    # Where a sweep read it back for its lost record: how it ended (``running`` as taken),
    # and whether its work had detached (a takeover takes detached work only).
    status: Status = Status.RUNNING
    detached: bool = True


class ClaimState(enum.StrEnum):
    ACQUIRED = "acquired"
    """This caller owns the claim: run the work."""
    RUNNING = "running"
    """Another owner holds a live lease: the work is under way elsewhere."""
    COMPLETED = "completed"
    """The work finished; its stored response can be replayed."""
    MISMATCH = "mismatch"
    """The key is in use with another fingerprint (another request body)."""


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A response to replay: status, allow-listed headers and the body chunk by chunk."""

    status: int
    headers: list[tuple[str, str]]
    chunks: list[bytes]
    generation_id: str | None = None


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    state: ClaimState
    retry_after: float | None = None
    response: StoredResponse | None = None
    generation_id: str | None = None


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What one request cost and what its client got.

    ``outcome`` is how the generation ended, in the words of its status, its log line and
    its error frame (docs/architecture.md, "How a generation ended"): ``complete`` (the
    protocol's terminal marker arrived), ``truncated`` (the stream ended without it),
    ``error`` (an error frame, an error status or an exception), ``cancelled`` (the client
    left and the policy cancelled, or its owner's Stop: ``stopped_by="owner"``),
    ``interrupted`` (a drain's deadline, ``stopped_by="drain"``; left to another replica,
    ``"handover"``; a shutdown or a lost owner) or ``unknown`` (the body could not be
    analysed; then ``usage_source`` is ``"none"``). ``policy`` is the route's policy
    (``cancel``, ``detach``) whether or not the client left; None only for a callable policy
    that was never asked (nobody left) or without DisconnectMiddleware. Token counts come
    from the provider when it sent usage (``usage_source="provider"``), else are estimated
    from the text (``"estimated"``), else unknown (``"none"``). ``produced_*`` is what the
    app produced;
    ``delivered_*`` is what reached the client: with ``delivery="acked"`` what its TCP
    acknowledged (a streamed response on Linux), with ``"sent"`` what was handed to the
    server.
    ``usage_note`` says how counts that are not the provider's were made (``"estimated at
    3.71 characters per token, calibrated on 12 answer(s) of gpt-4o"``), and what metering
    could not read (an event over its window, a JSON body over 4 MiB without usage at its
    end); None when the provider's counts are the record's.

    Keyword-only: ``UsageRecord(generation_id=..., principal=..., ...)``.
    """

    generation_id: str | None
    principal: str | None
    method: str
    route: str
    status_code: int | None
    provider: str | None
    model: str | None
    outcome: str
    input_tokens: int | None
    output_tokens: int | None
    usage_source: str
    produced_bytes: int
    delivered_bytes: int
    produced_output_tokens: int | None
    delivered_output_tokens: int | None
    time_to_first_event: float | None
    duration: float
    finish_reason: str | None
    error_type: str | None
    started_at: float
    cache_read_tokens: int | None = None
    reasoning_tokens: int | None = None
    policy: str | None = None
    detached: bool = False
    delivery: str = "sent"
    usage_note: str | None = None
    stopped_by: str | None = None
    """What ended the work, if not its client nor itself: ``owner`` (a Stop), ``drain`` (a
    drain's deadline) or ``handover`` (left to another replica, which finishes it)."""
    attempt: int = 1
    """Which upstream call of the generation this is: 1, or the n-th after takeovers (a
    replica that finished it after its owner died), each with a record of its own."""
