"""A throwaway PostgreSQL cluster that a test may stop, start and kill."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BIN = Path(os.environ.get("ASGI_DISCONNECT_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 5432:
            return port


class Cluster:
    """``initdb`` in a temporary directory, served on a free port of 127.0.0.1.

    Run as the OS user ``postgres`` when this process is root (PostgreSQL refuses root),
    as this process's user otherwise. Only this cluster's postmaster is ever signalled.
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="asgi-disconnect-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = _free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(str(BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-N")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\n"
                # Without fsync only a crash of the host loses commits; the tests crash the server.
                "fsync = off\nfull_page_writes = off\n"
                "shared_buffers = 16MB\nmax_connections = 60\n"
            )

    def _run(self, *argv: str, timeout: float = 60) -> None:
        if self._as_postgres:
            argv = ("runuser", "-u", "postgres", "--", *argv)
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited with {done.returncode}: "
                f"{done.stderr.decode(errors='replace')[-2000:]}"
            )

    def _ctl(self, *args: str) -> None:
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", *args)

    def start(self) -> None:
        """Start the server and wait until it accepts connections (after crash recovery)."""
        self._ctl("-l", str(self.log), "start")

    def stop(self, mode: str = "immediate") -> None:
        """``pg_ctl stop -m mode``: ``immediate`` drops every connection without a checkpoint."""
        self._ctl("-m", mode, "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster and every process it started: a crash of the server."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        children = _children(pid)
        for target in (pid, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in (pid, *children)) and time.monotonic() < deadline:
            time.sleep(0.02)

    def running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _alive(pid)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.stop()
        with contextlib.suppress(Exception):
            self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry))
    return found
