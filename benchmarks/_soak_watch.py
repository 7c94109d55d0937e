"""What each replica holds over a soak: RSS and open descriptors from ``/proc/<pid>``, asyncio
tasks from the gateway's ``GET /_soak/stats`` (appended to its source at runtime), and its
PostgreSQL connections (its TCP sockets to port 5432, matched by inode in ``/proc/<pid>``).

A thread samples every ``interval`` seconds; :meth:`ReplicaWatch.mark` names the moments the
report compares: the baseline (gateways up, no client yet) and after (clients gone, upstream
calls settled, the gateways idle a few seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

STATS_PATH = "/_soak/stats"
TRIM_PATH = "/_soak/trim"
STATS_ROUTE = f'''

import asyncio as _soak_asyncio
import ctypes as _soak_ctypes
import gc as _soak_gc
import sys as _soak_sys


@app.get("{STATS_PATH}")
async def _soak_stats() -> dict[str, int]:
    # blocks: the memory blocks CPython's allocator has handed out and not had back, the
    # live heap whatever RSS the process keeps.
    return {{
        "tasks": len(_soak_asyncio.all_tasks()),
        "blocks": _soak_sys.getallocatedblocks(),
    }}


@app.post("{TRIM_PATH}")
async def _soak_trim() -> dict[str, bool]:
    # What the process holds once the C allocator gave back the free memory it kept.
    _soak_gc.collect()
    try:
        trim = _soak_ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return {{"trimmed": False}}
    trim(0)
    return {{"trimmed": True}}
'''
PG_PORT = 5432
# Back to baseline: RSS may keep what allocators and caches hold after a burst (pymalloc
# arenas, the pool's prepared statements), so the larger of 20 MiB or 15 %; tasks and
# descriptors are counted, so a small constant (a pool connection opened or closed, a timer).
RSS_SLACK_MIB = 20.0
RSS_SLACK_SHARE = 0.15
COUNT_SLACK = 4
# The live heap (CPython's allocated blocks after a collection) may keep what warmed up
# once (the route table learned, a model's calibration, prepared statements): 10 %.
BLOCKS_SLACK_SHARE = 0.10


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _socket_inodes(pid: int) -> tuple[int, set[str]] | None:
    try:
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        return None
    return len(links), {link[8:-1] for link in links if link.startswith("socket:[")}


def _db_connections(pid: int, inodes: set[str]) -> int:
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == PG_PORT and fields[3] == "01" and fields[9] in inodes:
                    count += 1
    return count


def streams(pid: int, port: int) -> int:
    """The replica's established connections on ``port``: its clients' streams in flight."""
    held = _socket_inodes(pid)
    if held is None:
        return 0
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == "01" and fields[9] in held[1]:
                    count += 1
    return count


def _ask(host: str, port: int, path: str, method: str = "GET", timeout: float = 1.0) -> Any:
    """The gateway's JSON answer on ``path``; None if it gave none."""
    request = urllib.request.Request(f"http://{host}:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.load(reply)
    except (OSError, ValueError):
        return None


def _trim(host: str, port: int) -> bool:
    answer = _ask(host, port, TRIM_PATH, "POST", timeout=5.0)
    return bool(answer and answer.get("trimmed"))


def _stats(host: str, port: int) -> tuple[int | None, int | None]:
    """The gateway's tasks and CPython's allocated blocks (None, None: no answer)."""
    answer = _ask(host, port, STATS_PATH)
    try:
        return int(answer["tasks"]), int(answer["blocks"])
    except (TypeError, KeyError, ValueError):
        return None, None


class ReplicaWatch:
    """Samples every replica in a thread of its own until :meth:`stop`."""

    def __init__(
        self, host: str, ports: list[int], pids: Callable[[], list[int | None]], interval: float
    ) -> None:
        self.host = host
        self.ports = ports
        self.pids = pids
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self.marks: dict[str, float] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)

    def start(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sample(self) -> list[dict[str, Any]]:
        now = round(time.monotonic() - self.started, 2)
        taken = []
        for replica, pid in enumerate(self.pids()):
            if pid is None:
                continue
            held = _socket_inodes(pid)
            if held is None:
                continue
            fds, inodes = held
            tasks, blocks = _stats(self.host, self.ports[replica])
            taken.append(
                {
                    "t": now,
                    "replica": replica,
                    "rss_mib": _rss_mib(pid),
                    "fds": fds,
                    "db_connections": _db_connections(pid, inodes),
                    "streams": streams(pid, self.ports[replica]),
                    "tasks": tasks,
                    "blocks": blocks,
                }
            )
        self.samples.extend(taken)
        return taken

    def mark(self, name: str) -> None:
        """Name this moment, with a fresh sample of it."""
        self.marks[name] = round(time.monotonic() - self.started, 2)
        for s in self.sample():
            s["mark"] = name

    def trim(self) -> None:
        """Have each replica give the C allocator's free memory back (``malloc_trim``), then
        sample as ``trimmed``: RSS that stays is held by the process, not kept free by the
        allocator (glibc keeps freed heap and per-thread arenas for reuse)."""
        for replica, pid in enumerate(self.pids()):
            if pid is not None:
                _trim(self.host, self.ports[replica])
        self.mark("trimmed")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        keys = ("rss_mib", "blocks", "fds", "tasks", "db_connections")
        for replica in sorted({s["replica"] for s in self.samples}):
            mine = [s for s in self.samples if s["replica"] == replica]

            def at(mark: str, mine: list[dict[str, Any]] = mine) -> dict[str, Any] | None:
                found = [s for s in mine if s.get("mark") == mark]
                return found[-1] if found else None

            base, after, trimmed = at("baseline"), at("after"), at("trimmed")
            entry: dict[str, Any] = {}
            for key in keys:
                values = [s[key] for s in mine if s[key] is not None and s.get("mark") != "trimmed"]
                entry[key] = {
                    "baseline": base and base[key],
                    "peak": max(values) if values else None,
                    "after": after and after[key],
                }
            for key in ("rss_mib", "blocks"):
                entry[key]["trimmed"] = trimmed and trimmed.get(key)
            entry["back_to_baseline"] = _back(entry)
            out[f"replica{replica}"] = entry
        return out


def _back(entry: dict[str, Any]) -> dict[str, bool | None]:
    checks: dict[str, bool | None] = {}
    rss = entry["rss_mib"]
    # Judged once the allocator gave its free memory back, where that was measured.
    held = rss.get("trimmed") or rss["after"]
    if rss["baseline"] is None or held is None:
        checks["rss_mib"] = None
    else:
        slack = max(RSS_SLACK_MIB, rss["baseline"] * RSS_SLACK_SHARE)
        checks["rss_mib"] = held <= rss["baseline"] + slack
    blocks = entry.get("blocks")
    if blocks is not None:
        # The live heap, after a collection: what the process still holds of the burst.
        held_blocks = blocks.get("trimmed") or blocks["after"]
        if blocks["baseline"] is None or held_blocks is None:
            checks["blocks"] = None
        else:
            checks["blocks"] = held_blocks <= blocks["baseline"] * (1 + BLOCKS_SLACK_SHARE)
    for key in ("fds", "tasks"):
        v = entry[key]
        if v["baseline"] is None or v["after"] is None:
            checks[key] = None
        else:
            checks[key] = v["after"] <= v["baseline"] + COUNT_SLACK
    return checks


def lines(report: dict[str, Any]) -> list[str]:
    out = [
        "replicas (baseline / peak / after, and RSS once malloc_trim gave the allocator's free "
        "memory back; back to baseline):"
    ]
    for name, entry in report.items():
        parts = []
        for key in ("rss_mib", "blocks", "fds", "tasks", "db_connections"):
            v = entry.get(key)
            if v is None:
                continue
            part = f"{key} {_fmt(v['baseline'])}/{_fmt(v['peak'])}/{_fmt(v['after'])}"
            if v.get("trimmed") is not None:
                part += f" (trimmed {_fmt(v['trimmed'])})"
            parts.append(part)
        out.append(f"  {name}: " + ", ".join(parts) + f"; {entry['back_to_baseline']}")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    return "-" if value is None else str(value)
