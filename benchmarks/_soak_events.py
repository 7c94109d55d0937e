"""What happens to the replicas mid-soak: a rolling restart of replica 0 under drain (SIGTERM,
wait for it to exit, start it again on its port) and, with ``--chaos``, replica 1 killed
(SIGKILL) and started again, its detached generations left for the other to take over.

While a replica is down its clients connect to the other, as a load balancer would: the
clients read their port from ``routes`` when they connect, and the events rewrite it.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _soak_watch

EXIT_TIMEOUT = 60.0


class ReplicaEvents:
    """Runs the events in a thread of its own, at their share of ``duration``."""

    def __init__(
        self,
        procs: list[subprocess.Popen[bytes]],
        ports: list[int],
        routes: list[int],
        start: Callable[[int], subprocess.Popen[bytes]],
        plan: list[tuple[float, int, signal.Signals]],
    ) -> None:
        self.procs = procs
        self.ports = ports
        self.routes = routes
        self.start_replica = start
        self.plan = plan
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-events", daemon=True)
        self.started = 0.0

    def start(self) -> ReplicaEvents:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def join(self) -> None:
        self._stop.set()
        self._thread.join(EXIT_TIMEOUT + 40)

    def _at(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def _run(self) -> None:
        for at, replica, signum in self.plan:
            if self._stop.wait(max(0.0, self.started + at - time.monotonic())):
                return
            self._event(replica, signum)

    def _event(self, replica: int, signum: signal.Signals) -> None:
        other = (replica + 1) % len(self.ports)
        proc = self.procs[replica]
        event: dict[str, Any] = {
            "replica": replica,
            "signal": signum.name,
            "streams_in_flight": _soak_watch.streams(proc.pid, self.ports[replica]),
        }
        self.routes[replica] = self.ports[other]  # new clients go to the other replica
        event["signalled_at"] = self._at()
        proc.send_signal(signum)
        try:
            proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            event["killed_after_timeout"] = True
        event["exited_at"] = self._at()
        event["exit_code"] = proc.returncode
        try:
            self.procs[replica] = self.start_replica(replica)
        except RuntimeError as exc:
            event["restart_error"] = str(exc)
            self.events.append(event)
            return
        event["serving_again_at"] = self._at()
        self.routes[replica] = self.ports[replica]
        self.events.append(event)


def lines(events: list[dict[str, Any]]) -> list[str]:
    out = ["replica events (seconds from the clients' start):"]
    for e in events:
        out.append(
            f"  replica {e['replica']} {e['signal']} at {e['signalled_at']} s with "
            f"{e['streams_in_flight']} streams in flight; exited at {e['exited_at']} s "
            f"(code {e['exit_code']}); serving again at {e.get('serving_again_at', '-')} s"
            + (f"; {e['restart_error']}" if "restart_error" in e else "")
        )
    return out
