"""Two network namespaces of the test's own, joined by a veth pair: a server host and a
client host whose link the test cuts (a phone in a lift: no FIN, no RST), slows (tbf) or
brings back. Every address lives inside the two namespaces.

A thread enters a namespace with :func:`inside`; a socket keeps the namespace it was made
in, and a thread started inside inherits it, so a server started in a thread inside
``server_ns`` serves there while the test's own thread goes on outside.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

# How a thread enters a namespace: the soak makes its client hosts the same way.
from benchmarks._soak_net import inside as inside
from benchmarks._soak_net import unavailable as unavailable

SERVER_IP = "10.203.0.1"
CLIENT_IP = "10.203.0.2"
_counter = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def require() -> None:
    """Skip where namespaces cannot be made; under CI=true that is a failure."""
    problem = unavailable()
    if problem is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"network namespace tests cannot run: {problem}")
    pytest.skip(problem)


class Link:
    """The server host, the client host and the cable between them."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}x{next(_counter)}"
        self.server_ns = f"adsrv{tag}"
        self.client_ns = f"adcli{tag}"
        self.server_if = f"vs{tag}"[:15]
        self.client_if = f"vc{tag}"[:15]
        self.server_ip = SERVER_IP
        self.client_ip = CLIENT_IP

    def create(self) -> None:
        _ip("netns", "add", self.server_ns)
        _ip("netns", "add", self.client_ns)
        _ip(
            "link", "add", self.server_if, "netns", self.server_ns,
            "type", "veth", "peer", "name", self.client_if, "netns", self.client_ns,
        )  # fmt: skip
        for namespace, interface, address in (
            (self.server_ns, self.server_if, self.server_ip),
            (self.client_ns, self.client_if, self.client_ip),
        ):
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")

    def destroy(self) -> None:
        for namespace in (self.server_ns, self.client_ns):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", namespace)

    def cut(self) -> None:
        """The client's link goes down: what the server sends vanishes, nothing answers."""
        _ip("-n", self.client_ns, "link", "set", self.client_if, "down")

    def restore(self) -> None:
        _ip("-n", self.client_ns, "link", "set", self.client_if, "up")

    def slow(self, rate: str) -> None:
        """Shape what the server sends to ``rate`` (``"40kbit"``), queueing up to 10 s of it.

        A mobile link buffers seconds. With a queue of 1 s, most packets of a 36 KB answer were
        dropped, and TCP's retransmission backoff left the link unacknowledged for more than a
        3 s ``client_timeout`` in about one run of 30, which then cut a live client.
        """
        subprocess.run(
            ["tc", "-n", self.server_ns, "qdisc", "add", "dev", self.server_if, "root",
             "tbf", "rate", rate, "burst", "3000", "latency", "10s"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip

    def client_socket(self) -> socket.socket:
        """A TCP socket of the client host (not connected yet, non-blocking)."""
        with inside(self.client_ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        return sock


@contextlib.contextmanager
def link() -> Iterator[Link]:
    require()
    cable = Link()
    cable.create()
    try:
        yield cable
    finally:
        cable.destroy()
