"""The soak over time, as a PNG (``--png``; needs matplotlib, the ``bench`` extra): streams in
flight per replica (its established client connections, sampled), output tokens billed (the
provider's calls, each spread evenly from its start to its end) against delivered (the usage
records', at the time each was written), usage records written, and the replica events.
"""

from __future__ import annotations

from typing import Any


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(
    path: str,
    *,
    samples: list[dict[str, Any]],
    events: list[dict[str, Any]],
    calls: list[Any],
    records: list[Any],
    started: float,
    wall_offset: float,
) -> None:
    """``started``: the watch's zero (monotonic); ``wall_offset``: wall minus monotonic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (streams, tokens, written) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for replica in sorted({s["replica"] for s in samples}):
        mine = [s for s in samples if s["replica"] == replica]
        streams.plot(
            [s["t"] for s in mine], [s["streams"] for s in mine], label=f"replica {replica}"
        )
    streams.set_ylabel("streams in flight")

    ends = [c.closed_at for c in calls if c.closed_at is not None]
    horizon = max([*ends, started + (samples[-1]["t"] if samples else 0.0)]) - started
    grid = [horizon * i / 400 for i in range(401)]

    def billed_at(t: float) -> float:
        total = 0.0
        for c in calls:
            begin = c.started_at - started
            end = (c.closed_at or started + horizon) - started
            share = 1.0 if end <= begin else min(1.0, max(0.0, (t - begin) / (end - begin)))
            total += c.tokens_generated * share
        return total

    written_at = sorted(
        (r.started_at + r.duration - wall_offset - started, r.delivered_output_tokens or 0)
        for r in records
    )

    def delivered_at(t: float) -> float:
        return float(sum(n for at, n in written_at if at <= t))

    tokens.plot(grid, [billed_at(t) for t in grid], label="billed (provider)")
    tokens.plot(grid, [delivered_at(t) for t in grid], label="delivered (usage records)")
    tokens.set_ylabel("output tokens, cumulative")
    written.step(
        [at for at, _ in written_at], range(1, len(written_at) + 1), where="post", label="all"
    )
    written.set_ylabel("usage records written")
    written.set_xlabel("seconds from the baseline sample")
    for e in events:
        for ax in (streams, tokens, written):
            ax.axvspan(
                e["signalled_at"] + e.get("clock_shift", 0.0),
                e.get("serving_again_at", e["exited_at"]) + e.get("clock_shift", 0.0),
                color="red" if e["signal"] == "SIGKILL" else "orange",
                alpha=0.2,
            )
        streams.annotate(
            f"replica {e['replica']} {e['signal']}",
            (e["signalled_at"] + e.get("clock_shift", 0.0), 0),
            fontsize=8,
        )
    for ax in (streams, tokens, written):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("soak over time (shaded: a replica draining or down, until it serves again)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
