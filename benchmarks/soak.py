"""A seeded soak of the quickstart's gateway as production runs it: mobile-like clients, from
network namespaces of their own, against uvicorn replicas sharing one store.

``examples/gateway.py`` runs under uvicorn in subprocesses (two replicas on a PostgreSQL
schema of the soak's own, or ``--backend sqlite`` with one replica), changed in two places
only: its store's URL comes from the environment, and it forwards FakeProvider's
``x-fake-tokens``, ``x-fake-rate``, ``x-fake-first-token-delay`` and ``x-fake-fault``
headers beside the caller's. FakeProvider runs in this process. The clients live in groups of
``--group-size``, each group a network namespace joined to the machine by a veth pair, about
half of them shaped with tbf to a rate between 64 kbit/s and 5 Mbit/s (what the gateway
sends them), the rest at full speed.

Each client draws (from ``--seed``; one JSON line each to ``--log``): a replica, a route
(``/v1/chat/completions``, policy cancel, or ``/v1/reports``, policy detach), a short chat
(20-80 tokens) or a long report (300-900), a token rate, and a behaviour: ``read`` (to the
end), ``hangup-before`` (FIN once the response head arrived, before the first token),
``hangup-after`` (FIN after some tokens), ``stall`` (stops reading for 3-8 s, then reads
to the end), ``retry`` (FIN after some tokens, then the same request with the same
Idempotency-Key, read to the end), ``vanish`` (after some tokens it answers nothing: no FIN,
no RST), ``vanish-first`` (the same during a first token slower than the gateway's
``client_timeout``), ``vanish-retry`` (a vanish, then the same key on a new connection),
``flap`` (the link drops for 1-5 s, then the client reads on), ``think-flap`` (a first
token slower than ``client_timeout``, as a reasoning model's, arriving as the link drops for
1-3 s: a live client the gateway must not cut), ``resume`` (detach route: FIN
or vanish, then ``GET /generations/{id}/stream`` with ``Last-Event-ID`` or ``?offset=`` on a
drawn replica, read to the end), ``fault-error`` / ``fault-reset`` (the provider's error
frame or a TCP reset mid-stream) or ``refusal`` (the provider's 429; the client waits
Retry-After and sends the same key again). Each client has an address of its own in its
group's namespace; a vanish or a flap is a blackhole route for it on the machine's side
(with strict reverse-path filtering, so it is silent both ways), removed when it ends.
Every request carries an Idempotency-Key and the client's tag in the body's ``user``, so the
provider's own records say which client each upstream call served.

The figures come from the provider's counts (tokens generated per call), the clients'
receipts (tokens in whole events read from the socket) and the store's usage table, never
from the package's records alone:

- billed / delivered output tokens on the cancel route, overall and per kind (behaviour and
  link); the detach route beside it;
- usage records per generation (exactly one is the contract), each record's delivered
  tokens against the client's receipt;
- detached generations started against completed (the store's generations, and the
  provider's calls that finished after their client left);
- upstream runs per Idempotency-Key, and whether two ever overlapped; second runs by kind
  (after a cancelled, a faulted or a completed first run);
- tokens generated after a cancel-route client vanished (from the provider's pacing) against
  ``client_timeout`` x rate + one second's worth, and their share of the billed tokens;
- flaps read to the end; resumed bodies, stitched to the client's prefix, against the
  store's; each fault's answer (an error frame or status, never a silent truncation).

``violations()`` lists the targets that failed; ``--strict`` exits 1 if any did.

    python -m benchmarks.soak --clients 60 --duration 40 --seed 1 --json soak.json

Clients start within the first half of ``--duration``; at ``--duration`` the ones still
reading hang up; then up to 20 s for upstream calls to end, and the gateways stop (SIGTERM,
drain). Needs root, ``ip`` and ``tc``; otherwise it says why and exits 2. Every namespace it
made is removed on the way out, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asgi_disconnect.testing import FakeProvider
from asgi_disconnect.testing._socket_client import _ChunkedDecoder

from . import _soak_bare, _soak_events, _soak_net, _soak_png, _soak_targets, _soak_watch
from ._soak_targets import violations
from ._uvicorn import ROOT, uvicorn_command, wait_until_listening

GATEWAY = Path(ROOT) / "examples" / "gateway.py"
STORE_LINE = 'connect("sqlite:///generations.db")'
FORWARD_LINE = '"openai-project")'
FAKE_HEADERS = ("x-fake-tokens", "x-fake-rate", "x-fake-first-token-delay", "x-fake-fault")
BEHAVIOURS = (
    "read", "hangup-before", "hangup-after", "stall", "retry",
    "vanish", "vanish-first", "flap", "vanish-retry", "resume",
    "fault-error", "fault-reset", "refusal", "think-flap",
)  # fmt: skip
WEIGHTS = (0.2, 0.06, 0.09, 0.08, 0.08, 0.08, 0.05, 0.08, 0.06, 0.1, 0.04, 0.04, 0.04, 0.05)
FLAPS = ("flap", "think-flap")
VANISHES = ("vanish", "vanish-first", "vanish-retry")
FAULTS = ("fault-error", "fault-reset", "refusal")
# DisconnectMiddleware's client_timeout, its default, which the gateway keeps: a client whose
# TCP acknowledged nothing it was sent for that long is cut.
CLIENT_TIMEOUT = 10.0
ID_LINE = re.compile(rb"id: \d+\n(?=\r?\n)")
TOKEN = re.compile(rb'"content": ?"tok\d+ ')
SETTLE = 20.0
TAKEOVER_LINES = (
    (
        "idle_timeout=60,",
        'idle_timeout=60, upstream="openai", continuation="continue_final_message",',
    ),
    ("idempotency=True)", 'idempotency=True, upstreams={"openai": client})'),
)
RESTART_AT = 0.4
CHAOS_AT = 0.6
LEASES = 35.0  # after a SIGKILL: the generations' and the claims' leases (30 s), and a sweep
QUIET = 3.0  # after the upstream calls settled, before the gateways' "after" sample


def gateway_source(url_env: str) -> str:
    source = GATEWAY.read_text()
    for needle in (STORE_LINE, FORWARD_LINE):
        if source.count(needle) != 1:
            raise SystemExit(f"{GATEWAY} no longer has {needle!r} once: update benchmarks.soak")
    fake = ", ".join(f'"{h}"' for h in FAKE_HEADERS)
    source = source.replace(STORE_LINE, f'connect(os.environ["{url_env}"])')
    source = source.replace(FORWARD_LINE, f'"openai-project", {fake})')
    for needle, takeover in TAKEOVER_LINES:  # the quickstart does not opt in to takeover
        if source.count(needle) != 1:
            raise SystemExit(f"{GATEWAY} no longer has {needle!r} once: update benchmarks.soak")
        source = source.replace(needle, takeover)
    return source + _soak_watch.STATS_ROUTE


@dataclasses.dataclass
class Draw:
    client: int
    group: int
    link: str
    rate_kbit: int | None
    replica: int
    route: str
    length: str
    tokens: int
    token_rate: float
    behaviour: str
    start: float
    first_token_delay: float
    hangup_after_tokens: int | None
    stall_after_tokens: int | None
    stall_seconds: float | None
    retry_wait: float | None
    key: str
    address: str = ""
    vanish_after_tokens: int | None = None  # 0: right after the request was sent
    vanish_seconds: float | None = None
    flap_after_tokens: int | None = None
    flap_seconds: float | None = None
    flap_at_seconds: float | None = None
    fault: str | None = None
    resume_cut: str | None = None  # "hangup" or "vanish"
    resume_form: str | None = None  # "last-event-id" or "offset"
    resume_replica: int | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/reports"

    @property
    def policy(self) -> str:
        return "cancel" if self.route == "chat" else "detach"

    @property
    def kind(self) -> str:
        return f"{self.behaviour}/{self.link}"


def draw_population(args: argparse.Namespace) -> tuple[list[int | None], list[Draw]]:
    rng = random.Random(args.seed)
    groups = max(1, math.ceil(args.clients / args.group_size))
    rates: list[int | None] = [None]  # the first group (the gateways' address) at full speed
    for _ in range(1, groups):
        shaped = rng.random() < 0.5
        rates.append(int(math.exp(rng.uniform(math.log(64), math.log(5000)))) if shaped else None)
    window = args.duration * 0.4  # what a session may take at its token rate
    draws = []
    for client in range(args.clients):
        group = client % groups
        route = "chat" if rng.random() < 0.7 else "report"
        long = rng.random() < (0.25 if route == "chat" else 0.7)
        token_rate = rng.choice((20.0, 30.0, 50.0, 80.0))
        tokens = rng.randint(300, 900) if long else rng.randint(20, 80)
        tokens = max(10, min(tokens, int(token_rate * window)))
        behaviour = rng.choices(BEHAVIOURS, WEIGHTS)[0]
        if behaviour == "resume":
            route = "report"  # resuming by id is the detach route's
        cut = rng.randint(1, max(1, tokens // 2))
        extra = extra_draws(rng, args, behaviour, tokens, cut)
        first_token_delay = 0.0
        if behaviour == "hangup-before":
            first_token_delay = round(rng.uniform(1.0, 3.0), 2)
        elif behaviour == "vanish-first":  # silent for longer than the gateway waits for acks
            first_token_delay = round(CLIENT_TIMEOUT + rng.uniform(2.0, 6.0), 2)
            # Silent until the first token, then unacknowledged for the client_timeout.
            extra["vanish_seconds"] = round(first_token_delay + CLIENT_TIMEOUT + 5.0, 2)
        elif behaviour == "think-flap":
            # A reasoning model's first token, slower than client_timeout, arrives as the
            # phone's link drops for 1-3 s: a live client, never to be cut.
            first_token_delay = round(CLIENT_TIMEOUT + rng.uniform(1.0, 5.0), 2)
            extra["flap_at_seconds"] = round(first_token_delay - 0.3, 2)
            extra["flap_seconds"] = round(rng.uniform(1.0, 3.0), 2)
        draws.append(
            Draw(
                client=client,
                group=group,
                link="full" if rates[group] is None else "shaped",
                rate_kbit=rates[group],
                replica=rng.randrange(args.replicas),
                route=route,
                length="long" if long else "short",
                tokens=tokens,
                token_rate=token_rate,
                behaviour=behaviour,
                start=round(rng.uniform(0, args.duration * 0.5), 3),
                first_token_delay=first_token_delay,
                hangup_after_tokens=cut
                if behaviour in ("hangup-after", "retry") or extra.get("resume_cut") == "hangup"
                else None,
                stall_after_tokens=cut if behaviour == "stall" else None,
                stall_seconds=round(rng.uniform(3, 8), 2) if behaviour == "stall" else None,
                retry_wait=round(rng.uniform(0.3, 2.0), 2) if behaviour == "retry" else None,
                key=f"soak-{args.seed}-{client}-{rng.getrandbits(32):08x}",
                address=f"{_soak_net.PREFIX}.{group}.{10 + client // groups}",
                **extra,
            )
        )
    return rates, draws


def extra_draws(
    rng: random.Random, args: argparse.Namespace, behaviour: str, tokens: int, cut: int
) -> dict[str, Any]:
    """The draws of the vanishing, flapping, resuming and faulted populations."""
    out: dict[str, Any] = {}
    if behaviour in VANISHES:
        out["vanish_after_tokens"] = 0 if behaviour == "vanish-first" else cut
        out["vanish_seconds"] = round(CLIENT_TIMEOUT + rng.uniform(4.0, 6.0), 2)
    elif behaviour == "flap":
        out["flap_after_tokens"] = cut
        out["flap_seconds"] = round(rng.uniform(1.0, 5.0), 2)
    elif behaviour == "resume":
        out["resume_cut"] = rng.choice(("hangup", "vanish"))
        out["resume_form"] = rng.choice(("last-event-id", "offset"))
        out["resume_replica"] = rng.randrange(args.replicas)
        if out["resume_cut"] == "vanish":
            out["vanish_after_tokens"] = cut
            out["vanish_seconds"] = round(CLIENT_TIMEOUT + rng.uniform(4.0, 6.0), 2)
    elif behaviour == "fault-error":
        out["fault"] = f"error-after={cut}"
    elif behaviour == "fault-reset":
        out["fault"] = f"reset-after={cut}"
    elif behaviour == "refusal":
        out["fault"] = "status=429"
    return out


@dataclasses.dataclass
class Attempt:
    status: int = 0
    generation_id: str | None = None
    replayed: bool = False
    tokens: int = 0
    bytes: int = 0
    complete: bool = False
    hung_up: bool = False
    cut_at_deadline: bool = False
    error: str | None = None
    retry_after: float | None = None
    vanished_at: float | None = None
    resumed_from: int | None = None
    sse_ids: bool = False
    body: bytes = dataclasses.field(default=b"", repr=False)
    sent_at: float | None = None  # monotonic: the request written
    first_byte_at: float | None = None
    first_token_at: float | None = None


def _count_tokens(body: bytes) -> int:
    whole = body[: body.rfind(b"\n\n") + 2] if b"\n\n" in body else b""
    return len(TOKEN.findall(whole))


async def attempt(
    group: _soak_net.Group,
    address: tuple[str, int],
    draw: Draw,
    *,
    hang_up_at: int | None,
    before_first: bool,
    stall: tuple[int, float] | None,
    deadline: float,
    vanish: tuple[int, float] | None = None,
    flap: tuple[int, float] | None = None,
    flap_at: tuple[float, float] | None = None,
    fault: str | None = None,
    request_head: str | None = None,
) -> Attempt:
    """One HTTP/1.1 request from ``draw``'s own address, read as ``draw`` says (the POST,
    or ``request_head`` as given)."""
    loop = asyncio.get_running_loop()
    result = Attempt()
    sock = group.socket(draw.address)
    body = json.dumps(
        {
            "model": "fake-model",
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": f"soak-{draw.client}",
            "messages": [{"role": "user", "content": f"client {draw.client}"}],
        }
    ).encode()
    head = {
        "host": f"{address[0]}:{address[1]}",
        "content-type": "application/json",
        "authorization": f"Bearer soak-{draw.client % 7}",
        "idempotency-key": draw.key,
        "x-fake-tokens": str(draw.tokens),
        "x-fake-rate": str(draw.token_rate),
        "content-length": str(len(body)),
    }
    if draw.first_token_delay:
        head["x-fake-first-token-delay"] = str(draw.first_token_delay)
    if fault is not None:
        head["x-fake-fault"] = fault
    request = f"POST {draw.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
    payload = request.encode() + b"\r\n" + body
    if request_head is not None:
        payload = request_head.encode() + b"\r\n"
    buffer = b""
    decoded = bytearray()
    dechunk = _ChunkedDecoder()
    length: int | None = None
    stalled = False

    def feed(data: bytes) -> None:
        nonlocal buffer, length
        if not result.status:
            buffer += data
            if b"\r\n\r\n" not in buffer:
                return
            raw, _, data = buffer.partition(b"\r\n\r\n")
            first, *rest = raw.decode("latin-1").split("\r\n")
            result.status = int(first.split()[1])
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in rest)}
            result.generation_id = headers.get("x-generation-id")
            result.replayed = headers.get("idempotent-replayed") == "true"
            with contextlib.suppress(KeyError, ValueError):
                result.retry_after = float(headers["retry-after"])
            if "content-length" in headers:
                length = int(headers["content-length"])
            if result.status in (204, 304):
                length = 0
        if length is not None:
            decoded.extend(data)
            result.complete = len(decoded) >= length
        else:
            decoded.extend(dechunk.feed(data))
            result.complete = dechunk.done
        result.bytes = len(decoded)
        result.body = bytes(decoded)
        if result.bytes and result.first_byte_at is None:
            result.first_byte_at = time.monotonic()
        result.tokens = _count_tokens(result.body)
        if result.tokens and result.first_token_at is None:
            result.first_token_at = time.monotonic()

    def drain() -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                feed(data)

    def hang_up() -> None:
        drain()  # what the kernel holds was received
        result.hung_up = True
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)  # the FIN
        sock.close()

    async def go_silent() -> None:
        """Stop answering: no FIN, no RST; the machine drops what the gateway sends."""
        await asyncio.to_thread(group.blackhole, draw.address)
        result.vanished_at = time.monotonic()
        assert vanish is not None
        await asyncio.sleep(max(0.0, min(vanish[1], deadline - time.monotonic() - 0.5)))

    async def flap_link(seconds: float, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        await asyncio.to_thread(group.blackhole, draw.address)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(group.restore, draw.address)

    flapping: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, payload)
            result.sent_at = time.monotonic()
            if flap_at is not None:
                flapping = asyncio.create_task(flap_link(flap_at[1], after=flap_at[0]))
            if vanish is not None and vanish[0] == 0:
                await go_silent()
                return result
            while not result.complete:
                data = await loop.sock_recv(sock, 65536)
                if not data:
                    break
                feed(data)
                if vanish is not None and result.status and result.tokens >= vanish[0]:
                    await go_silent()
                    return result
                if flap is not None and flapping is None and result.tokens >= flap[0]:
                    flapping = asyncio.create_task(flap_link(flap[1]))
                if before_first and result.status and result.tokens == 0:
                    hang_up()
                    return result
                if hang_up_at is not None and result.tokens >= hang_up_at:
                    hang_up()
                    return result
                if stall is not None and not stalled and result.tokens >= stall[0]:
                    stalled = True
                    await asyncio.sleep(stall[1])
    except TimeoutError:
        result.cut_at_deadline = True
        if result.vanished_at is None:
            hang_up()
            return result
    except OSError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if flapping is not None:
            flapping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flapping
        if result.vanished_at is not None:
            # Gone for good: no FIN on the way out either (the gateway cut it by now).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            await asyncio.to_thread(group.restore, draw.address)
    sock.close()
    return result


async def client(
    draw: Draw,
    group: _soak_net.Group,
    ports: list[int],
    started: float,
    deadline: float,
) -> list[Attempt]:
    await asyncio.to_thread(group.add_address, draw.address)
    await asyncio.sleep(max(0.0, started + draw.start - time.monotonic()))
    address = (_soak_net.PREFIX + ".0.1", ports[draw.replica])
    vanish = None
    if draw.vanish_after_tokens is not None:
        vanish = (draw.vanish_after_tokens, draw.vanish_seconds or CLIENT_TIMEOUT)
    flap = None
    if draw.flap_after_tokens is not None:
        flap = (draw.flap_after_tokens, draw.flap_seconds or 1.0)
    attempts = [
        await attempt(
            group,
            address,
            draw,
            hang_up_at=draw.hangup_after_tokens,
            before_first=draw.behaviour == "hangup-before",
            stall=(draw.stall_after_tokens or 0, draw.stall_seconds or 0.0)
            if draw.behaviour == "stall"
            else None,
            deadline=deadline,
            vanish=vanish,
            flap=flap,
            flap_at=(draw.flap_at_seconds, draw.flap_seconds or 1.0)
            if draw.flap_at_seconds is not None
            else None,
            fault=draw.fault,
        )
    ]
    if attempts[0].cut_at_deadline:
        return attempts
    if draw.behaviour == "resume":
        if attempts[0].generation_id and attempts[0].status == 200:
            await asyncio.sleep(draw.retry_wait or 0.5)
            attempts.append(await resume(draw, group, ports, attempts[0], deadline))
        return attempts
    if draw.behaviour == "refusal" and attempts[0].status == 429:
        await asyncio.sleep(min(5.0, attempts[0].retry_after or 1.0))
    elif draw.behaviour not in ("retry", "vanish-retry"):
        return attempts
    await asyncio.sleep(draw.retry_wait or 0.0)
    for _ in range(20):  # the same request, the same key, to the end; 409: try again
        if time.monotonic() >= deadline:
            break
        address = (address[0], ports[draw.replica])  # its replica may be down: rerouted
        again = await attempt(
            group, address, draw, hang_up_at=None, before_first=False, stall=None, deadline=deadline
        )
        attempts.append(again)
        if again.status not in (409, 429):
            break
        await asyncio.sleep(min(5.0, again.retry_after or 1.0))
    return attempts


async def resume(
    draw: Draw, group: _soak_net.Group, ports: list[int], first: Attempt, deadline: float
) -> Attempt:
    """Reload the page: ``GET /generations/{id}/stream`` from where the client's copy ends,
    on the drawn replica, as the same caller; read to the end."""
    replica = draw.resume_replica or 0
    address = (_soak_net.PREFIX + ".0.1", ports[replica])
    head = {
        "host": f"{address[0]}:{address[1]}",
        "authorization": f"Bearer soak-{draw.client % 7}",
    }
    path = f"/generations/{first.generation_id}/stream"
    if draw.resume_form == "last-event-id":
        offset = first.body.rfind(b"\n\n") + 2 if b"\n\n" in first.body else 0
        head["accept"] = "text/event-stream"
        head["last-event-id"] = str(offset)
    else:
        offset = len(first.body)
        path += f"?offset={offset}"
    request = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
    result = await attempt(
        group, address, draw, hang_up_at=None, before_first=False, stall=None,
        deadline=deadline, request_head=request,
    )  # fmt: skip
    result.resumed_from = offset
    result.sse_ids = draw.resume_form == "last-event-id"
    return result


def stitched(first: Attempt, resumed: Attempt) -> bytes:
    """The body a resuming client ends up with: its prefix, then what the resume sent (less
    the ``id:`` lines an SSE resume adds to each event)."""
    rest = ID_LINE.sub(b"", resumed.body) if resumed.sse_ids else resumed.body
    return first.body[: resumed.resumed_from or 0] + rest


def start_gateways(
    work: Path, replicas: int, store: str, logs: list[Any], procs: list[subprocess.Popen[bytes]]
) -> tuple[list[int], Callable[[int], subprocess.Popen[bytes]]]:
    """The replicas, one after the other (the first prepares the schema): their ports, and
    how to start replica ``i`` again on its port."""
    (work / "gateway.py").write_text(gateway_source("SOAK_STORE"))
    host = _soak_net.PREFIX + ".0.1"
    env = {
        **os.environ,
        "SOAK_STORE": store,
        "UPSTREAM_URL": os.environ["SOAK_UPSTREAM"],
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    ports: list[int] = []

    def start(replica: int) -> subprocess.Popen[bytes]:
        port = ports[replica]
        log = open(work / f"replica{replica}.log", "ab")  # noqa: SIM115
        logs.append(log)
        command = uvicorn_command("gateway:app", port, host=host)
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=log)
        wait_until_listening(port, 30, f"replica {replica} (see {log.name})", host=host, proc=proc)
        return proc

    for replica in range(replicas):
        with socket.socket() as probe:
            probe.bind((host, 0))
            ports.append(int(probe.getsockname()[1]))
        procs.append(start(replica))
    return ports, start


def stop_gateways(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def run_clients(
    draws: list[Draw], groups: list[_soak_net.Group], ports: list[int], duration: float
) -> list[list[Attempt]]:
    started = time.monotonic()
    deadline = started + duration
    return list(
        await asyncio.gather(*(client(d, groups[d.group], ports, started, deadline) for d in draws))
    )


async def settle(provider: FakeProvider, timeout: float) -> int:
    """Wait for every upstream call to end; the number still open at the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(r.closed_at is not None for r in provider.requests):
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # a flush interval or few: the last records reach the store
    return sum(r.closed_at is None for r in provider.requests)


async def read_store(store: str, generation_ids: list[str], schema: str | None) -> dict[str, Any]:
    from asgi_disconnect import connect

    backend = connect(store)
    await backend.open()
    try:
        usage = {g: await backend.usage_of(g) for g in generation_ids}
        infos = await backend.store.recent(1_000_000, None)  # type: ignore[attr-defined]
        rows: dict[str, int] = {}
        bodies = {
            i.id: await backend.read_all(i.id, i.size) for i in infos if i.id in generation_ids
        }  # type: ignore[attr-defined]
        if schema is not None:
            fetched = await backend.store.pool.fetch(  # type: ignore[attr-defined]
                f'select generation_id, count(*) from "{schema}".asgi_disconnect_usage group by 1'
            )
            rows = {r[0]: int(r[1]) for r in fetched}
        else:
            for info in infos:
                rows[info.id] = len(await backend.usage_of(info.id))
    finally:
        await backend.aclose()
    return {"usage": usage, "infos": infos, "rows": rows, "bodies": bodies}


def ratio(billed: int, delivered: int) -> float | None:
    return round(billed / delivered, 3) if delivered else None


def figures(
    draws: list[Draw],
    results: list[list[Attempt]],
    provider: FakeProvider,
    stored: dict[str, Any],
    open_calls: int,
) -> dict[str, Any]:
    calls: dict[str, list[Any]] = collections.defaultdict(list)
    for call in provider.requests:
        calls[str(call.body.get("user"))].append(call)

    def billed(d: Draw) -> int:
        return sum(c.tokens_generated for c in calls[f"soak-{d.client}"])

    def delivered(attempts: list[Attempt]) -> int:
        return sum(a.tokens for a in attempts)

    out: dict[str, Any] = {}
    for policy in ("cancel", "detach"):
        mine = [(d, r) for d, r in zip(draws, results, strict=True) if d.policy == policy]
        kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for d, r in mine:
            for kind in ("all", d.kind, f"{d.length}"):
                kinds[kind][0] += 1
                kinds[kind][1] += billed(d)
                kinds[kind][2] += delivered(r)
        out[f"billed_over_delivered_{policy}"] = {
            k: {"clients": n, "billed": b, "delivered": dv, "ratio": ratio(b, dv)}
            for k, (n, b, dv) in sorted(kinds.items())
        }

    # Usage records: per generation a client saw, and over the whole usage table.
    seen = {}
    for d, r in zip(draws, results, strict=True):
        for a in r:
            if a.generation_id and not a.replayed:
                seen[a.generation_id] = (d, a)
    per_request = collections.Counter(len(v) for v in stored["usage"].values())
    # One record per upstream call: a generation taken over has one for each attempt.
    per_attempt: collections.Counter[int] = collections.Counter()
    for records in stored["usage"].values():
        counted = collections.Counter(r.attempt for r in records)
        per_attempt.update(counted.values() or [0])
    table = collections.Counter(stored["rows"].values())
    matches = {"equal": 0, "record_more": 0, "record_less": 0, "none_in_record": 0}
    differences = []
    byte_match = {"equal": 0, "differ": 0}
    byte_differences = []
    for gid, records in stored["usage"].items():
        if len(records) != 1:
            continue
        d, a = seen[gid]
        byte_match["equal" if records[0].delivered_bytes == a.bytes else "differ"] += 1
        if records[0].delivered_bytes != a.bytes:
            byte_differences.append(
                {"generation": gid, "client": d.client, "kind": d.kind, "route": d.route,
                 "record_delivered_bytes": records[0].delivered_bytes,
                 "record_produced_bytes": records[0].produced_bytes, "received_bytes": a.bytes,
                 "complete_at_client": a.complete, "cut_at_deadline": a.cut_at_deadline,
                 "outcome": records[0].outcome, "delivery": records[0].delivery}
            )  # fmt: skip
        got = records[0].delivered_output_tokens
        if got is None:
            matches["none_in_record"] += 1
        elif got == a.tokens:
            matches["equal"] += 1
        else:
            matches["record_more" if got > a.tokens else "record_less"] += 1
            differences.append(
                {"generation": gid, "client": d.client, "kind": d.kind, "record": got,
                 "receipt": a.tokens, "outcome": records[0].outcome,
                 "usage_source": records[0].usage_source,
                 "record_delivered_bytes": records[0].delivered_bytes,
                 "record_produced_bytes": records[0].produced_bytes,
                 "received_bytes": a.bytes, "delivery": records[0].delivery,
                 "detached": records[0].detached, "route": d.route}
            )  # fmt: skip
    # The record's output tokens against what the provider generated for that call: the
    # client's attempts that reached the provider, in order, against its calls, in order.
    billed_vs_record = {"equal": 0, "record_more": 0, "record_less": 0, "unknown": 0}
    sources: collections.Counter[str] = collections.Counter()
    for d, r in zip(draws, results, strict=True):
        mine = sorted(calls[f"soak-{d.client}"], key=lambda c: c.started_at)
        ran = [a for a in r if a.generation_id and not a.replayed and a.status == 200]
        if len(ran) != len(mine):
            billed_vs_record["unknown"] += len(ran)
            continue
        for a, call in zip(ran, mine, strict=True):
            records = stored["usage"].get(a.generation_id or "", [])
            if len(records) != 1 or records[0].output_tokens is None:
                billed_vs_record["unknown"] += 1
                continue
            sources[records[0].usage_source] += 1
            got = records[0].output_tokens
            if got == call.tokens_generated:
                billed_vs_record["equal"] += 1
            else:
                billed_vs_record[
                    "record_more" if got > call.tokens_generated else "record_less"
                ] += 1
    requests = sum(len(r) for r in results)
    no_id = sum(1 for r in results for a in r if not a.generation_id)
    out["usage_records"] = {
        "requests_sent": requests,
        "requests_without_generation_id": no_id,
        "generations_seen_by_clients": len(seen),
        "records_per_seen_generation": dict(sorted(per_request.items())),
        "records_per_attempt": dict(sorted(per_attempt.items())),
        "generations_in_store": len(stored["infos"]),
        "records_per_generation_in_usage_table": dict(sorted(table.items())),
        "stored_generations_without_record": sum(
            1 for info in stored["infos"] if info.id not in stored["rows"]
        ),
        "without_record": [
            {
                "generation": info.id,
                "status": str(getattr(info.status, "value", info.status)),
                "policy": info.policy,
                "detached": info.detached,
                "attempt": info.attempt,
                "error": info.error,
                "client": seen[info.id][0].client if info.id in seen else None,
                "kind": seen[info.id][0].kind if info.id in seen else None,
            }
            for info in stored["infos"]
            if info.id not in stored["rows"]
        ][:10],
        "upstream_calls": len(provider.requests),
        "delivered_bytes_record_vs_received": byte_match,
        "delivered_record_vs_receipt": matches,
        "output_record_vs_provider": billed_vs_record,
        "usage_sources": dict(sources),
        "differences": differences[:20],
        "byte_differences": byte_differences[:20],
        "byte_differences_by_kind": dict(
            collections.Counter(b["kind"].split("/")[0] for b in byte_differences)
        ),
    }

    # Detach: the store's generations, and the provider's calls whose client left.
    detached = [i for i in stored["infos"] if i.detached]
    statuses = collections.Counter(str(getattr(i.status, "value", i.status)) for i in detached)
    left = [
        c
        for d, r in zip(draws, results, strict=True)
        if d.policy == "detach" and r[0].hung_up
        for c in calls[f"soak-{d.client}"][:1]
    ]
    out["detach"] = {
        "started": len(detached),
        "completed": statuses.get("complete", 0),
        "statuses": dict(statuses),
        "upstream_calls_whose_client_left": len(left),
        "of_which_finished_upstream": sum(1 for c in left if c.finished),
    }

    # Idempotency-Keys: upstream runs per key, and whether two ran at once.
    runs = collections.Counter()
    overlapping = 0
    by_policy: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for d in draws:
        mine = calls[f"soak-{d.client}"]
        runs[len(mine)] += 1
        by_policy[d.policy][len(mine)] += 1
        spans = sorted((c.started_at, c.closed_at or math.inf) for c in mine)
        overlapping += any(b[0] < a[1] for a, b in itertools_pairwise(spans))
    retries = [r for d, r in zip(draws, results, strict=True) if d.behaviour == "retry"]
    out["idempotency"] = {
        "keys": len(draws),
        "upstream_runs_per_key": dict(sorted(runs.items())),
        "by_policy": {p: dict(sorted(c.items())) for p, c in by_policy.items()},
        "keys_with_overlapping_runs": overlapping,
        "retry_statuses": dict(
            collections.Counter(
                f"{a.status}{' replayed' if a.replayed else ''}" for r in retries for a in r[1:]
            )
        ),
    }
    out.update(population_figures(draws, results, calls, stored))
    out["clients"] = {
        "errors": sum(1 for r in results for a in r if a.error),
        "cut_at_deadline": sum(1 for r in results for a in r if a.cut_at_deadline),
        "statuses": dict(collections.Counter(str(a.status) for r in results for a in r)),
        "upstream_calls_open_after_settle": open_calls,
    }
    return out


def tokens_by(call: Any, draw: Draw, when: float) -> int:
    """Tokens the provider had generated for ``call`` by ``when``, from its pacing: the first
    after the drawn delay, then one every 1/rate s (it keeps no per-token times)."""
    first = call.started_at + draw.first_token_delay
    if when < first:
        return 0
    return min(call.tokens_generated, int((when - first) * draw.token_rate) + 1)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def population_figures(
    draws: list[Draw], results: list[list[Attempt]], calls: dict[str, list[Any]],
    stored: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Vanishes, flaps, resumes, faults and second runs per key."""
    out: dict[str, Any] = {}
    pairs = list(zip(draws, results, strict=True))

    def mine(d: Draw) -> list[Any]:
        return sorted(calls[f"soak-{d.client}"], key=lambda c: c.started_at)

    # Silence: tokens generated after the client stopped acknowledging (cancel route).
    after_vanish: list[float] = []
    after_silent: list[float] = []
    over_bound: list[float] = []
    cut_seconds: list[float] = []
    silence_cost = 0
    cancel_billed = 0
    rows = []
    for d, r in pairs:
        if d.policy == "cancel":
            cancel_billed += sum(c.tokens_generated for c in calls[f"soak-{d.client}"])
        if d.policy != "cancel" or r[0].vanished_at is None or not mine(d):
            continue
        call = mine(d)[0]
        vanished = r[0].vanished_at
        silent_from = max(vanished, call.started_at + d.first_token_delay)
        after = call.tokens_generated - tokens_by(call, d, vanished)
        after_first_unacked = call.tokens_generated - tokens_by(call, d, silent_from)
        bound = CLIENT_TIMEOUT * d.token_rate + d.token_rate
        after_vanish.append(after)
        after_silent.append(after_first_unacked)
        over_bound.append(after_first_unacked / bound)
        silence_cost += after
        if call.closed_at is not None and not call.finished:
            cut_seconds.append(call.closed_at - vanished)
        rows.append(
            {"client": d.client, "behaviour": d.behaviour, "rate": d.token_rate,
             "after_vanish": after, "after_first_unacked": after_first_unacked,
             "bound": bound, "generated": call.tokens_generated, "finished": call.finished,
             "closed_after_vanish_s": None if call.closed_at is None
             else round(call.closed_at - vanished, 2)}
        )  # fmt: skip
    out["silence"] = {
        "client_timeout": CLIENT_TIMEOUT,
        "cancel_route_vanishes": len(rows),
        "finished_before_the_cut": sum(1 for x in rows if x["finished"]),
        "tokens_after_vanish_p50": percentile(after_vanish, 0.5),
        "tokens_after_vanish_p99": percentile(after_vanish, 0.99),
        "tokens_after_first_unacked_p50": percentile(after_silent, 0.5),
        "tokens_after_first_unacked_p99": percentile(after_silent, 0.99),
        "over_bound_p99": percentile(over_bound, 0.99),
        "cut_seconds_p50": percentile(cut_seconds, 0.5),
        "cut_seconds_p99": percentile(cut_seconds, 0.99),
        "share_of_cancel_billed": round(silence_cost / cancel_billed, 4) if cancel_billed else None,
        "worst": sorted(rows, key=lambda x: -x["after_first_unacked"] / x["bound"])[:5],
    }

    # Flaps: the link comes back and the client reads on to the end.
    flaps = [(d, r) for d, r in pairs if d.behaviour in FLAPS]
    out["flaps"] = {
        "clients": len(flaps),
        "read_to_end": sum(1 for _, r in flaps if r[0].complete),
        "cut_at_deadline": sum(1 for _, r in flaps if r[0].cut_at_deadline),
        "not_complete_count": sum(
            1 for _, r in flaps if not r[0].complete and not r[0].cut_at_deadline
        ),
        "not_complete": [
            {"client": d.client, "route": d.route, "seconds": d.flap_seconds,
             "tokens": r[0].tokens, "of": d.tokens, "status": r[0].status}
            for d, r in flaps if not r[0].complete and not r[0].cut_at_deadline
        ][:10],
    }  # fmt: skip

    # Resumes: the prefix the client had, then what the resume sent, against the store.
    resumes = {"clients": 0, "resumed": 0, "byte_equal": 0, "differ": 0, "statuses": {}}
    statuses: collections.Counter[str] = collections.Counter()
    differ = []
    for d, r in pairs:
        if d.behaviour != "resume":
            continue
        resumes["clients"] += 1
        if len(r) < 2 or r[0].generation_id is None:
            continue
        resumes["resumed"] += 1
        statuses[f"{d.resume_form}/{d.resume_cut}: {r[1].status}"] += 1
        stored_body = stored["bodies"].get(r[0].generation_id)
        if stored_body is not None and stitched(r[0], r[1]) == stored_body:
            resumes["byte_equal"] += 1
        else:
            resumes["differ"] += 1
            differ.append(
                {"client": d.client, "generation": r[0].generation_id, "form": d.resume_form,
                 "cut": d.resume_cut, "replica": d.resume_replica, "offset": r[1].resumed_from,
                 "status": r[1].status, "prefix_bytes": r[0].bytes, "resumed_bytes": r[1].bytes,
                 "stitched_bytes": len(stitched(r[0], r[1])),
                 "stored_bytes": None if stored_body is None else len(stored_body),
                 "complete": r[1].complete, "error": r[1].error}
            )  # fmt: skip
    resumes["statuses"] = dict(statuses)
    resumes["differences"] = differ[:10]
    out["resumes"] = resumes

    # Faults and refusals: an error frame or an error status, never a silent truncation.
    faults: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    truncations = []
    for d, r in pairs:
        if d.behaviour not in FAULTS:
            continue
        a = r[0]
        if a.status == 0:
            answer = "no response"
        elif a.status >= 400:
            answer = f"status {a.status}"
        elif b"event: error" in a.body or b'data: {"error"' in a.body:
            answer = "error frame"
        elif b"[DONE]" in a.body:
            answer = "done"
        else:
            answer = "silent truncation"
            truncations.append(
                {"client": d.client, "fault": d.fault, "generation": a.generation_id,
                 "bytes": a.bytes, "complete": a.complete, "tail": a.body[-120:].decode(
                     "utf-8", "replace")}
            )  # fmt: skip
        faults[d.behaviour][answer] += 1
        if d.behaviour == "refusal" and len(r) > 1:
            faults[d.behaviour][f"retry {r[-1].status}{' complete' if r[-1].complete else ''}"] += 1
        for x in r:
            if x.generation_id and not x.replayed:
                faults[d.behaviour][f"records {len(stored['usage'].get(x.generation_id, []))}"] += 1
    out["faults"] = {
        "answers": {k: dict(v) for k, v in faults.items()},
        "silent_truncations": truncations[:10],
        "silent_truncation_count": len(truncations),
    }

    # Vanish then retry, beside hang-up then retry.
    out["retry_after_vanish"] = dict(
        collections.Counter(
            f"{d.route}: {a.status}{' replayed' if a.replayed else ''}"
            f"{' complete' if a.complete else ''}"
            for d, r in pairs if d.behaviour == "vanish-retry" for a in r[1:]
        )
    )  # fmt: skip

    # Second upstream runs per key: after a cancelled first run (the cancel route's design),
    # after a refused or faulted one, or after one that completed or still ran (violations).
    second: collections.Counter[str] = collections.Counter()
    bad = []
    for d, _r in pairs:
        runs = mine(d)
        for first, later in itertools.pairwise(runs):
            if later.started_at < (first.closed_at or math.inf):
                kind = "overlapping"
            elif first.finished and not first.fault_applied:
                kind = "after a completed first run"
            elif first.fault_applied:
                kind = "after a faulted or refused first run"
            elif d.policy == "cancel":
                kind = "after a cancelled first run"
            else:
                kind = "after an unfinished detached first run"
            second[f"{d.policy}: {kind}"] += 1
            if kind in ("overlapping", "after a completed first run"):
                bad.append({"client": d.client, "behaviour": d.behaviour, "kind": kind})
    out["second_runs"] = {
        "kinds": dict(second),
        "violations": bad[:10],
        "violation_count": len(bad),
    }

    # Detached generations that did not complete (a fault upstream is not the store's loss).
    faulted = {a.generation_id for d, r in pairs if d.behaviour in FAULTS for a in r}
    lost = [
        i.id for i in stored["infos"]
        if i.detached and str(getattr(i.status, "value", i.status)) != "complete"
        and i.id not in faulted
    ]  # fmt: skip
    out["detached_lost"] = {"count": len(lost), "ids": lost[:10]}
    out["attempts"] = {
        str(d.client): [
            {k: v for k, v in dataclasses.asdict(a).items() if k != "body"}
            | {"calls": [repr(c) for c in mine(d)]}
            for a in r
        ]
        for d, r in pairs
        if d.behaviour not in ("read", "stall")
    }
    return out


def set_aside_the_killed(
    fig: dict[str, Any], draws: list[Draw], results: list[list[Attempt]], events: Any
) -> None:
    """A flap whose replica was SIGKILLed while it read was ended by the kill, not cut by the
    gateway: counted apart from the live clients cut."""
    kills = [
        (e["replica"], events.started + e["signalled_at"])
        for e in events.events
        if e["signal"] == "SIGKILL"
    ]
    killed = {
        d.client
        for d, r in zip(draws, results, strict=True)
        for replica, at in kills
        if d.replica == replica and r and (r[0].sent_at or math.inf) < at and not r[0].complete
    }
    flaps = fig["flaps"]
    cut = [x for x in flaps["not_complete"] if x["client"] not in killed]
    flaps["ended_by_a_kill"] = flaps["not_complete_count"] - len(cut)
    flaps["not_complete_count"] = len(cut)
    flaps["not_complete"] = cut


def itertools_pairwise(items: list[Any]) -> list[tuple[Any, Any]]:
    return list(itertools.pairwise(items))


def summary(args: argparse.Namespace, rates: list[int | None], fig: dict[str, Any]) -> str:
    shaped = [r for r in rates if r is not None]
    lines = [
        f"soak: {args.clients} clients, seed {args.seed}, {args.duration:g} s, "
        f"{args.replicas} replica(s) on {args.backend}; {len(rates)} groups, "
        f"{len(shaped)} shaped" + (f" ({min(shaped)}-{max(shaped)} kbit/s)" if shaped else ""),
        "",
        "billed / delivered output tokens (provider's counts / clients' receipts)",
    ]
    for policy in ("cancel", "detach"):
        lines.append(f"  {policy} route:")
        for kind, f in fig[f"billed_over_delivered_{policy}"].items():
            lines.append(
                f"    {kind:22} {f['clients']:4d} clients  billed {f['billed']:7d}  "
                f"delivered {f['delivered']:7d}  ratio {f['ratio']}"
            )
    u = fig["usage_records"]
    lines += [
        "",
        f"usage records: {u['requests_sent']} requests ({u['requests_without_generation_id']}"
        f" without a generation id at the client), {u['upstream_calls']} upstream calls",
        f"  per generation a client saw ({u['generations_seen_by_clients']}): "
        f"{u['records_per_seen_generation']}",
        f"  usage table, per generation ({u['generations_in_store']} in the store): "
        f"{u['records_per_generation_in_usage_table']}; without a record: "
        f"{u['stored_generations_without_record']}",
        f"  record's delivered bytes against the bytes received: "
        f"{u['delivered_bytes_record_vs_received']} (differ by behaviour: "
        f"{u.get('byte_differences_by_kind', {})}; a resume's bytes are its reload's)",
        f"  record's delivered tokens against the receipt: {u['delivered_record_vs_receipt']}",
        f"  record's output tokens against the provider's call: {u['output_record_vs_provider']}"
        f" (usage_source {u['usage_sources']})",
    ]
    d = fig["detach"]
    lines += [
        f"detach: started {d['started']}, completed {d['completed']} ({d['statuses']}); "
        f"provider: {d['of_which_finished_upstream']} of "
        f"{d['upstream_calls_whose_client_left']} calls whose client left finished",
    ]
    i = fig["idempotency"]
    lines += [
        f"idempotency: upstream runs per key {i['upstream_runs_per_key']} "
        f"(cancel {i['by_policy'].get('cancel', {})}, detach {i['by_policy'].get('detach', {})});"
        f" keys with overlapping runs: {i['keys_with_overlapping_runs']}; "
        f"retry answers {i['retry_statuses']}",
        f"clients: {fig['clients']}",
    ]
    lines += population_summary(fig)
    return "\n".join(lines)


def population_summary(fig: dict[str, Any]) -> list[str]:
    s, f, r, q = fig["silence"], fig["flaps"], fig["resumes"], fig["second_runs"]
    problems = violations(fig)
    return [
        f"silence (cancel route, client_timeout {s['client_timeout']:g} s): "
        f"{s['cancel_route_vanishes']} vanishes ({s['finished_before_the_cut']} finished "
        "upstream before any cut); tokens generated after the vanish "
        f"p50 {s['tokens_after_vanish_p50']} p99 {s['tokens_after_vanish_p99']}; after the "
        f"first unacknowledged byte p50 {s['tokens_after_first_unacked_p50']} "
        f"p99 {s['tokens_after_first_unacked_p99']} ({s['over_bound_p99']}x the bound at p99); "
        f"cut (calls that did not finish), after the vanish: p50 {s['cut_seconds_p50']} s "
        f"p99 {s['cut_seconds_p99']} s; "
        f"{s['share_of_cancel_billed']} of the cancel route's billed tokens",
        f"flaps: {f['read_to_end']} of {f['clients']} read to the end "
        f"({f['cut_at_deadline']} cut at the deadline)",
        f"resumes: {r['resumed']} of {r['clients']} resumed, {r['byte_equal']} byte-equal to "
        f"the store, {r['differ']} differ; {r['statuses']}",
        f"retry after a vanish: {fig['retry_after_vanish']}",
        f"faults: {fig['faults']['answers']}",
        f"second upstream runs per key: {q['kinds']}",
        f"detached lost: {fig['detached_lost']['count']}; Idempotency-Key claims by status: "
        f"{fig.get('targets', {}).get('claims', {})}",
        "targets: " + ("all held" if not problems else "NOT HELD: " + "; ".join(problems)),
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds (default 120)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=5, help="clients per namespace")
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="the database; the soak makes a schema of its own there and drops it after",
    )
    parser.add_argument(
        "--log",
        default=os.path.join(tempfile.gettempdir(), "soak-clients.jsonl"),
        help="one JSON line per draw (default: in the temporary directory)",
    )
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 if a target (see violations()) failed"
    )
    parser.add_argument(
        "--bare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="then the same draws, read to the end, against a bare relay: time to first byte",
    )
    parser.add_argument("--png", help="draw the soak over time here (needs matplotlib)")
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"restart replica 0 under drain at {RESTART_AT * 100:.0f}%% of --duration "
        "(two replicas)",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help=f"SIGKILL replica 1 at {CHAOS_AT * 100:.0f}%% of --duration and start it again",
    )
    args = parser.parse_args(argv)
    args.replicas = 2 if args.backend == "postgres" else 1
    if math.ceil(args.clients / args.group_size) > 250:
        parser.error("at most 250 groups: raise --group-size")
    return args


async def drop_schema(url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'drop schema if exists "{schema}" cascade')
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    problem = _soak_net.unavailable()
    if problem is not None:
        print(f"cannot make network namespaces here: {problem}", file=sys.stderr)
        return 2
    rates, draws = draw_population(args)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does

    signal.signal(signal.SIGTERM, interrupted)
    with open(args.log, "w") as log:
        for d in draws:
            log.write(json.dumps(dataclasses.asdict(d)) + "\n")
    groups = [_soak_net.Group(i, rate) for i, rate in enumerate(rates)]
    schema = f"soak_{os.getpid()}" if args.backend == "postgres" else None
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    provider = FakeProvider(tokens=50, tokens_per_second=40).start()
    watch: _soak_watch.ReplicaWatch | None = None
    try:
        for group in groups:
            group.create()
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            work = Path(tmp)
            if schema is not None:
                store = f"{args.postgres}?schema={schema}"
            else:
                store = f"sqlite:///{work / 'generations.db'}"
            os.environ["SOAK_UPSTREAM"] = provider.url
            ports, start = start_gateways(work, args.replicas, store, logs, procs)
            watch = _soak_watch.ReplicaWatch(
                _soak_net.PREFIX + ".0.1",
                ports,
                lambda: [p.pid if p.poll() is None else None for p in procs],
                interval=0.5,
            ).start()
            time.sleep(QUIET)  # the pools' first connections, the first flush
            watch.mark("baseline")
            routes = list(ports)  # where each replica's clients connect; the events reroute
            plan = []
            if args.restart and args.replicas > 1:
                plan.append((RESTART_AT * args.duration, 0, signal.SIGTERM))
            if args.chaos and args.replicas > 1:
                plan.append((CHAOS_AT * args.duration, 1, signal.SIGKILL))
            events = _soak_events.ReplicaEvents(procs, ports, routes, start, plan).start()
            results = asyncio.run(run_clients(draws, groups, routes, args.duration))
            events.join()
            for e in events.events:  # a killed replica's leases run out, the other takes over
                if e["signal"] == "SIGKILL":
                    time.sleep(
                        max(0.0, events.started + e["exited_at"] + LEASES - time.monotonic())
                    )
            open_calls = asyncio.run(settle(provider, SETTLE))
            time.sleep(QUIET)
            watch.mark("after")
            watch.trim()
            watch.stop()
            stop_gateways(procs)
            seen = sorted(
                {a.generation_id for r in results for a in r if a.generation_id and not a.replayed}
            )
            stored = asyncio.run(read_store(store, seen, schema))
            claims = asyncio.run(_soak_targets.claim_statuses(store, schema))
            fig = figures(draws, results, provider, stored, open_calls)
            fig["targets"] = {"claims": claims}
            fig["replica_events"] = events.events
            set_aside_the_killed(fig, draws, results, events)
            fig["replicas"] = watch.report()
            fig["replica_samples"] = watch.samples
            fig["ttfb"] = {"gateway": _soak_bare.ttfb(results)}
            main_calls = list(provider.requests)  # the bare phase's calls are not the soak's
            if args.bare:
                relay, port = _soak_bare.start(_soak_net.PREFIX + ".0.1", work, logs)
                procs.append(relay)
                bare = asyncio.run(
                    run_clients(_soak_bare.readers(draws), groups, [port], args.duration)
                )
                stop_gateways([relay])
                fig["ttfb"]["bare"] = _soak_bare.ttfb(bare)
            for log in logs:
                log.close()
            errors = {
                Path(log.name).name: [
                    line
                    for line in Path(log.name).read_text(errors="replace").splitlines()
                    if "Traceback" in line or "ERROR" in line
                ]
                for log in logs
            }
            fig["gateway_log_errors"] = {name: len(lines) for name, lines in errors.items()}
            # uvicorn's line for a silent client cut a moment before the kernel closed it is
            # counted; every other error line is kept, to be read.
            fig["gateway_log_error_lines"] = {
                name: [line for line in lines if "without completing response" not in line][:50]
                for name, lines in errors.items()
            }
        if args.png:
            if _soak_png.available():
                shift = events.started - watch.started
                _soak_png.draw(
                    args.png,
                    samples=watch.samples,
                    events=[{**e, "clock_shift": shift} for e in events.events],
                    calls=main_calls,
                    records=[r for rs in stored["usage"].values() for r in rs],
                    started=watch.started,
                    wall_offset=time.time() - time.monotonic(),
                )
            else:
                print("--png: matplotlib is not installed (the bench extra)", file=sys.stderr)
        print(summary(args, rates, fig))
        print("\n".join(_soak_bare.lines(fig["ttfb"])))
        print("\n".join(_soak_events.lines(fig["replica_events"])))
        print("\n".join(_soak_watch.lines(fig["replicas"])))
        print(f"gateway log errors: {fig['gateway_log_errors']}")
        print(f"targets: {violations(fig) or 'all held'}")
        if args.json:
            fig["args"] = {k: v for k, v in vars(args).items()}
            fig["group_rates_kbit"] = rates
            Path(args.json).write_text(json.dumps(fig, indent=2, default=str))
        return 1 if args.strict and violations(fig) else 0
    finally:
        if watch is not None:
            watch.stop()
        stop_gateways(procs)
        for log in logs:
            log.close()
        provider.stop()
        for group in groups:
            group.destroy()
        if schema is not None:
            with contextlib.suppress(Exception):
                asyncio.run(drop_schema(args.postgres, schema))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; every namespace, gateway and schema it made is gone", file=sys.stderr)
        sys.exit(130)
