"""The SQL stores' rows read back as the package's records, and a stored response written.

Shared by the SQLite and PostgreSQL stores; a low module of ``_backends`` that imports only
the records.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .._records import Adopted, Claim, ClaimState, GenerationInfo, Status, StoredResponse

__all__ = ["adopted_from_row", "claim_from_row", "encode_response", "info_from_row", "join_from"]


def adopted_from_row(row: Any) -> Adopted:
    """A generation row taken over (id, principal, attempt, size, status_code, content_type,
    policy, created_at, continuation[, status, detached])."""
    return Adopted(
        status=Status(row[9]) if len(row) > 9 else Status.RUNNING,
        detached=bool(row[10]) if len(row) > 10 else True,
        id=row[0],
        principal=row[1],
        attempt=row[2],
        size=row[3],
        status_code=row[4],
        content_type=row[5],
        policy=row[6],
        created_at=row[7],
        continuation=bytes(row[8]),
    )


def encode_response(response: StoredResponse) -> bytes:
    return msgspec.msgpack.encode(response)


def info_from_row(row: Any) -> tuple[GenerationInfo, str]:
    """A generation row (id, status, policy, size, status_code, content_type, created_at,
    finished_at, detached, error, principal[, attempt, owner]) as its info and its
    principal."""
    return (
        GenerationInfo(
            id=row[0],
            status=Status(row[1]),
            policy=row[2],
            size=row[3],
            status_code=row[4],
            content_type=row[5],
            created_at=row[6],
            finished_at=row[7],
            detached=bool(row[8]),
            error=row[9],
            attempt=row[11] if len(row) > 11 else 1,
            owner=row[12] if len(row) > 12 else None,
        ),
        row[10],
    )


def join_from(rows: Any, offset: int, limit: int) -> bytes:
    """Chunk rows (start, data), in order, joined from byte ``offset``; about ``limit`` bytes."""
    parts: list[bytes] = []
    total = 0
    for start, data in rows:
        data = bytes(data)
        if start < offset:
            data = data[offset - start :]
        if not data:
            continue
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    return b"".join(parts)


def claim_from_row(row: Any, fingerprint: bytes) -> Claim:
    """Read a claim someone else holds: (status, fingerprint, seconds left, response, gen)."""
    if row is None:
        # Released between our insert and our read: the next attempt may take it.
        return Claim(state=ClaimState.RUNNING, retry_after=0.0)
    status, stored_fingerprint, left, response, generation_id = row
    if bytes(stored_fingerprint) != fingerprint:
        return Claim(state=ClaimState.MISMATCH)
    if status == "completed":
        stored = msgspec.msgpack.decode(bytes(response), type=StoredResponse)
        return Claim(state=ClaimState.COMPLETED, response=stored, generation_id=generation_id)
    return Claim(
        state=ClaimState.RUNNING,
        retry_after=max(0.0, float(left or 0.0)),
        generation_id=generation_id,
    )
