"""The soak's network: one namespace per group of clients, each joined to the machine's own
namespace by a veth pair, the gateway's side shaped with tbf where the group is a slow link.

The gateways listen in the machine's namespace on the first group's address; every group
routes to it through its own veth. Deleting a namespace deletes its veth pair with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
PREFIX = "10.213"


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@contextlib.contextmanager
def inside(namespace: str) -> Iterator[None]:
    """Run the calling thread in ``namespace`` for the block, then where it was."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, timeout=10)


def unavailable() -> str | None:
    """Why this machine cannot make namespaces, or None."""
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"soakprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    _run("ip", "netns", "del", probe)
    return None


class Group:
    """A client host: a namespace, its veth to the machine, an optional tbf rate."""

    def __init__(self, index: int, rate_kbit: int | None) -> None:
        tag = f"{os.getpid() % 100000}g{index}"
        self.index = index
        self.rate_kbit = rate_kbit
        self.namespace = f"soak{tag}"
        self.host_if = f"skh{tag}"[:15]
        self.client_if = f"skc{tag}"[:15]
        self.host_ip = f"{PREFIX}.{index}.1"
        self.client_ip = f"{PREFIX}.{index}.2"
        self.made = False
        self.addresses: set[str] = set()
        self.blackholed: set[str] = set()

    @property
    def link(self) -> str:
        return "full" if self.rate_kbit is None else "shaped"

    def create(self) -> None:
        _run("ip", "netns", "add", self.namespace)
        self.made = True
        _run(
            "ip", "link", "add", self.host_if, "type", "veth",
            "peer", "name", self.client_if, "netns", self.namespace,
        )  # fmt: skip
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        # Strict reverse-path filtering: a blackholed client's own packets are dropped too,
        # so a vanished client is silent both ways (its kernel's retransmissions included).
        _run("sysctl", "-qw", f"net.ipv4.conf.{self.host_if}.rp_filter=1")
        ns = ("ip", "-n", self.namespace)
        _run(*ns, "link", "set", "lo", "up")
        _run(*ns, "addr", "add", f"{self.client_ip}/24", "dev", self.client_if)
        _run(*ns, "link", "set", self.client_if, "up")
        _run(*ns, "route", "add", "default", "via", self.host_ip)
        if self.rate_kbit is not None:
            # What the gateway sends to this group, queueing up to 10 s of it (a mobile
            # link buffers seconds), as tests/integration/netns.py shapes its link.
            _run(
                "tc", "qdisc", "add", "dev", self.host_if, "root", "tbf",
                "rate", f"{self.rate_kbit}kbit", "burst", "3000", "latency", "10s",
            )  # fmt: skip

    def client_address(self, n: int) -> str:
        """The n-th client's own address in this namespace (a /32 beside the group's)."""
        return f"{PREFIX}.{self.index}.{10 + n}"

    def add_address(self, address: str) -> None:
        if address not in self.addresses:
            _run("ip", "-n", self.namespace, "addr", "add", f"{address}/32", "dev", self.client_if)
            self.addresses.add(address)

    def blackhole(self, address: str) -> None:
        """The machine drops what it sends to ``address``, and (rp_filter) what comes from it:
        that client answers nothing."""
        _run("ip", "route", "add", "blackhole", f"{address}/32")
        self.blackholed.add(address)

    def restore(self, address: str) -> None:
        if address in self.blackholed:
            self.blackholed.discard(address)
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _run("ip", "route", "del", "blackhole", f"{address}/32")

    def destroy(self) -> None:
        for address in list(self.blackholed):  # in the machine's namespace: not deleted with it
            self.restore(address)
        if self.made:
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _run("ip", "netns", "del", self.namespace)
            self.made = False
        # A veth whose namespace could not be made, or that outlived it.
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            _run("ip", "link", "del", self.host_if)

    def socket(self, address: str | None = None) -> socket.socket:
        """A TCP socket of this client host (not connected yet, non-blocking), bound to
        ``address`` (one of `add_address`'s) if given."""
        with inside(self.namespace):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if address is not None:
            sock.bind((address, 0))
        sock.setblocking(False)
        return sock
