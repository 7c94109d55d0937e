"""The soak's operational targets, read from its figures: what a test asserts and the summary
prints. ``violated`` returns the ones missed, empty when all held.
"""

from __future__ import annotations

import collections
import sqlite3
import time
from typing import Any

from asgi_disconnect.testing import FakeProvider


def reruns_after_completion(provider: FakeProvider) -> int:
    """Keys (one client each) whose upstream ran again after a run of theirs had finished."""
    calls: dict[str, list[Any]] = collections.defaultdict(list)
    for call in provider.requests:
        calls[str(call.body.get("user"))].append(call)
    count = 0
    for mine in calls.values():
        mine.sort(key=lambda c: c.started_at)
        count += any(a.finished for a in mine[:-1])
    return count


async def claim_statuses(store: str, schema: str | None) -> dict[str, int]:
    """The Idempotency-Key claims left in the store, by status."""
    if schema is not None:
        import asyncpg

        conn = await asyncpg.connect(store.split("?", 1)[0])
        try:
            rows = await conn.fetch(
                f"select status || case when status = 'running' and lease_until < now() "
                f"then ' (lease lapsed)' else '' end, count(*) "
                f'from "{schema}".asgi_disconnect_claims group by 1'
            )
        finally:
            await conn.close()
        return {str(r[0]): int(r[1]) for r in rows}
    with sqlite3.connect(store.removeprefix("sqlite:///")) as conn:
        found = conn.execute(
            "select status || case when status = 'running' and lease_until < ? "
            "then ' (lease lapsed)' else '' end, count(*) from asgi_disconnect_claims group by 1",
            (time.time(),),
        )
        return {str(status): int(n) for status, n in found}


def violated(fig: dict[str, Any]) -> list[str]:
    out = []
    u = fig["usage_records"]
    per_seen = {str(k): v for k, v in u["records_per_seen_generation"].items()}
    if set(per_seen) - {"1"}:
        out.append(f"usage records per generation a client saw: {per_seen}, not one each")
    if fig["targets"]["keys_rerun_after_completion"]:
        out.append(f"keys run again after a completed run: {fig['targets']}")
    claimed = fig["targets"]["claims"].get("running", 0)
    if claimed:
        out.append(f"{claimed} Idempotency-Key claims left running, their lease live")
    d = fig["detach"]
    if d["started"] != d["completed"]:
        out.append(f"detached generations lost: started {d['started']}, statuses {d['statuses']}")
    for name, entry in fig["replicas"].items():
        missed = [k for k, ok in entry["back_to_baseline"].items() if ok is False]
        if missed:
            out.append(f"{name} not back to baseline: {missed} ({entry})")
    return out
