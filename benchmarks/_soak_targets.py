"""The soak's targets, read from its figures: what its test asserts, what the summary prints
and what ``--strict`` exits on. ``violations`` returns the ones missed, empty when all held.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any


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


def violations(fig: dict[str, Any]) -> list[str]:
    """The soak's targets that did not hold (empty: all held). Figures a run did not make
    (a unit test's hand-made ones) are not judged."""
    out = []
    u = fig["usage_records"]
    per_attempt = {int(k): v for k, v in u.get("records_per_attempt", {1: 1}).items()}
    if set(per_attempt) - {1}:
        out.append(f"usage records per upstream call: {per_attempt}, not one each")
    if u["stored_generations_without_record"]:
        out.append(f"{u['stored_generations_without_record']} stored generations without a record")
    if fig["second_runs"]["violation_count"]:
        out.append(f"{fig['second_runs']['violation_count']} keys ran upstream twice after a "
                   "completed or overlapping first run")  # fmt: skip
    claimed = fig.get("targets", {}).get("claims", {}).get("running", 0)
    if claimed:
        out.append(f"{claimed} Idempotency-Key claims left running, their lease live")
    if fig["detached_lost"]["count"]:
        out.append(f"{fig['detached_lost']['count']} detached generations lost")
    if fig["resumes"]["differ"]:
        out.append(f"{fig['resumes']['differ']} resumed bodies differ from the stored body")
    if fig["faults"]["silent_truncation_count"]:
        out.append(f"{fig['faults']['silent_truncation_count']} faults silently truncated")
    cut = fig["flaps"].get("not_complete_count", len(fig["flaps"]["not_complete"]))
    if cut:
        out.append(f"{cut} live clients cut: a link that dropped for less than client_timeout")
    p99 = fig["silence"]["over_bound_p99"]
    if p99 is not None and p99 > 1.0:
        out.append(f"silence p99 at {p99}x the bound (client_timeout x rate + 1 s of tokens)")
    for name, entry in fig.get("replicas", {}).items():
        missed = [k for k, ok in entry["back_to_baseline"].items() if ok is False]
        if missed:
            out.append(f"{name} not back to baseline: {missed} ({entry})")
    return out
