"""``application/problem+json`` responses (RFC 9457) with stable ``type`` URIs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from starlette.types import Send

PROBLEM_BASE = "urn:asgi-disconnect:problem:"

_encode = msgspec.json.Encoder().encode


def problem_body(status: int, slug: str, title: str, detail: str | None = None) -> bytes:
    """RFC 9457's members, and an ``error`` object in the shape the openai and anthropic
    SDKs read, so that their exceptions carry the reason (``code``, ``type``, ``message``)."""
    body: dict[str, object] = {"type": PROBLEM_BASE + slug, "title": title, "status": status}
    if detail is not None:
        body["detail"] = detail
    body["error"] = {
        "type": slug.replace("-", "_"),
        "code": slug,
        "message": detail if detail is not None else title,
    }
    return _encode(body)


async def send_problem(
    send: Send,
    status: int,
    slug: str,
    title: str,
    detail: str | None = None,
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = problem_body(status, slug, title, detail)
    raw = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if headers:
        raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, body: bytes, *, head: bool = False) -> None:
    """A JSON answer that no cache keeps; ``head``: its headers only."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"" if head else body})
