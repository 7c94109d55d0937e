"""The soak's ``--bare`` phase: the same draws, as plain readers, against a bare relay
(``benchmarks._bare_relay``) served as the gateways are, and time to first byte and to the
first token, p50/p99, beside the gateway's."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from ._uvicorn import ROOT, uvicorn_command, wait_until_listening


def start(host: str, work: Path, logs: list[Any]) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = int(probe.getsockname()[1])
    env = {
        **os.environ,
        "UPSTREAM_URL": os.environ["SOAK_UPSTREAM"],
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    log = open(work / "bare.log", "ab")  # noqa: SIM115
    logs.append(log)
    command = uvicorn_command("benchmarks._bare_relay:app", port, host=host)
    proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=log)
    wait_until_listening(port, 30, f"the bare relay (see {log.name})", host=host, proc=proc)
    return proc, port


def readers(draws: list[Any]) -> list[Any]:
    """The same draws, each read to the end, all to one replica (the relay)."""
    return [
        dataclasses.replace(
            d,
            replica=0,
            behaviour="read",
            hangup_after_tokens=None,
            stall_after_tokens=None,
            stall_seconds=None,
            retry_wait=None,
            first_token_delay=0.0,
        )
        for d in draws
    ]


def _quantiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    return {"n": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99)}


def ttfb(results: list[list[Any]]) -> dict[str, Any]:
    """Request sent to first body byte, and to the first token, over every first attempt."""
    firsts = [r[0] for r in results if r and r[0].sent_at is not None]
    return {
        "first_byte": _quantiles(
            [a.first_byte_at - a.sent_at for a in firsts if a.first_byte_at is not None]
        ),
        "first_token": _quantiles(
            [a.first_token_at - a.sent_at for a in firsts if a.first_token_at is not None]
        ),
    }


def lines(fig: dict[str, Any]) -> list[str]:
    out = ["time to first byte / first token (ms, p50 / p99, first attempts):"]
    for name, f in fig.items():
        b, t = f["first_byte"], f["first_token"]
        out.append(
            f"  {name:8} byte {b.get('p50_ms')} / {b.get('p99_ms')} (n {b['n']}), "
            f"token {t.get('p50_ms')} / {t.get('p99_ms')} (n {t['n']})"
        )
    return out
