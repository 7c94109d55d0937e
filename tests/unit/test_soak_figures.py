"""The soak's targets, from figures made by hand: what a failed target looks like in
``violations()``, which ``--strict`` turns into a non-zero exit."""

from __future__ import annotations

import argparse
import collections
from types import SimpleNamespace
from typing import Any

from benchmarks import soak

DONE = b"data: [DONE]\n\n"


def population() -> list[soak.Draw]:
    args = argparse.Namespace(seed=3, clients=40, group_size=5, duration=60.0, replicas=2)
    return soak.draw_population(args)[1]


def call(started: float, closed: float, *, finished: bool, tokens: int = 10) -> SimpleNamespace:
    return SimpleNamespace(
        started_at=started, closed_at=closed, finished=finished, fault_applied=False,
        tokens_generated=tokens,
    )  # fmt: skip


def figures(draws: list[soak.Draw], results: list[list[soak.Attempt]], calls: Any) -> Any:
    stored = {"usage": {}, "infos": [], "rows": {}, "bodies": {}, "claimed": 0}
    return soak.population_figures(draws, results, calls, stored)


def with_usage(fig: dict[str, Any]) -> dict[str, Any]:
    usage = {"records_per_seen_generation": {1: 3}, "stored_generations_without_record": 0}
    return {**fig, "usage_records": usage}


def test_a_second_run_after_a_completed_first_run_is_a_violation() -> None:
    draws = population()
    results = [[soak.Attempt(status=200, body=DONE, complete=True)] for _ in draws]
    calls: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)
    chat = next(d for d in draws if d.policy == "cancel")
    calls[f"soak-{chat.client}"] = [call(0, 1, finished=True), call(2, 3, finished=True)]
    fig = with_usage(figures(draws, results, calls))
    assert fig["second_runs"]["kinds"] == {"cancel: after a completed first run": 1}
    assert any("ran upstream twice" in v for v in soak.violations(fig))


def test_a_second_run_after_a_cancelled_first_run_is_reported_not_a_violation() -> None:
    draws = population()
    results = [[soak.Attempt(status=200, body=DONE, complete=True)] for _ in draws]
    calls: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)
    chat = next(d for d in draws if d.policy == "cancel")
    calls[f"soak-{chat.client}"] = [call(0, 1, finished=False), call(2, 3, finished=True)]
    fig = with_usage(figures(draws, results, calls))
    assert fig["second_runs"]["kinds"] == {"cancel: after a cancelled first run": 1}
    assert soak.violations(fig) == []


def test_an_sse_resume_stitches_to_the_prefix_without_its_ids() -> None:
    stored = b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
    first = soak.Attempt(status=200, body=stored[:13])  # a torn second event
    resumed = soak.Attempt(
        status=200, body=b"data: b\nid: 18\n\ndata: [DONE]\nid: 32\n\n", resumed_from=9,
        sse_ids=True,
    )  # fmt: skip
    assert soak.stitched(first, resumed) == stored


def test_a_stitched_body_that_differs_from_the_store_is_a_violation() -> None:
    draws = population()
    resume = next(d for d in draws if d.behaviour == "resume")
    results = [[soak.Attempt(status=200, body=DONE, complete=True)] for _ in draws]
    results[resume.client] = [
        soak.Attempt(status=200, generation_id="gen_1", body=b"data: a\n\n"),
        soak.Attempt(status=200, body=b"data: x\n\n", resumed_from=9),
    ]
    fig = soak.population_figures(
        draws, results, collections.defaultdict(list),
        {"usage": {}, "infos": [], "rows": {}, "bodies": {"gen_1": b"data: a\n\ndata: b\n\n"},
         "claimed": 0},
    )  # fmt: skip
    assert fig["resumes"]["differ"] == 1
    assert any("resumed bodies differ" in v for v in soak.violations(with_usage(fig)))


def test_a_live_client_cut_after_a_short_drop_is_a_violation() -> None:
    """A flap shorter than client_timeout (or a link that drops as a slow first token
    arrives) must read to its end: a client cut there was alive."""
    draws = population()
    flap = next(d for d in draws if d.behaviour in soak.FLAPS)
    results = [[soak.Attempt(status=200, body=DONE, complete=True)] for _ in draws]
    results[flap.client] = [soak.Attempt(status=200, body=b"data: a\n\n")]
    fig = with_usage(figures(draws, results, collections.defaultdict(list)))
    assert fig["flaps"]["not_complete_count"] == 1
    assert any("live clients cut" in v for v in soak.violations(fig))


def _watched(after: float, trimmed: float | None, blocks: int = 210_000) -> dict[str, Any]:
    from benchmarks import _soak_watch

    watch = _soak_watch.ReplicaWatch("127.0.0.1", [1], lambda: [], interval=1.0)
    common = {"replica": 0, "fds": 10, "tasks": 5, "db_connections": 3, "streams": 0}
    watch.samples = [
        {**common, "t": 0.0, "rss_mib": 64.0, "blocks": 200_000, "mark": "baseline"},
        {**common, "t": 1.0, "rss_mib": 110.0, "blocks": 900_000, "fds": 200},
        {**common, "t": 2.0, "rss_mib": after, "blocks": blocks, "mark": "after"},
    ]
    if trimmed is not None:
        watch.samples.append(
            {**common, "t": 3.0, "rss_mib": trimmed, "blocks": blocks, "mark": "trimmed"}
        )
    return watch.report()


def test_memory_is_judged_once_the_allocator_gave_its_free_memory_back() -> None:
    """RSS that stays at the peak only until malloc_trim is the allocator's, not held; RSS
    that stays after it is a violation, and both figures are printed."""
    from benchmarks import _soak_watch

    kept = _watched(after=109.5, trimmed=70.0)["replica0"]
    assert kept["rss_mib"] == {"baseline": 64.0, "peak": 110.0, "after": 109.5, "trimmed": 70.0}
    assert kept["back_to_baseline"]["rss_mib"] is True
    held = _watched(after=109.5, trimmed=105.0)
    assert held["replica0"]["back_to_baseline"]["rss_mib"] is False
    (line,) = [line for line in _soak_watch.lines(held) if "replica0" in line]
    assert "64.0/110.0/109.5 (trimmed 105.0)" in line
    # Where nothing trimmed (not glibc), RSS after the soak is what is judged.
    assert _watched(after=109.5, trimmed=None)["replica0"]["back_to_baseline"]["rss_mib"] is False


def test_the_live_heap_is_judged_by_the_blocks_the_allocator_handed_out() -> None:
    """RSS kept but the live heap back (within 10 %): retention, not a leak; a heap that
    stays grown is named as such."""
    back = _watched(after=109.5, trimmed=90.0, blocks=215_000)["replica0"]
    assert back["blocks"] == {
        "baseline": 200_000, "peak": 900_000, "after": 215_000, "trimmed": 215_000
    }  # fmt: skip
    assert back["back_to_baseline"]["blocks"] is True
    grown = _watched(after=109.5, trimmed=90.0, blocks=400_000)["replica0"]
    assert grown["back_to_baseline"]["blocks"] is False
