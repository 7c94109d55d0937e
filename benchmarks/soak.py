"""A seeded soak of the quickstart's gateway as production runs it: mobile-like clients, from
network namespaces of their own, against uvicorn replicas sharing one store.

``examples/gateway.py`` runs under uvicorn in subprocesses (two replicas on a PostgreSQL
schema of the soak's own, or ``--backend sqlite`` with one replica), changed in two places
only: its store's URL comes from the environment, and it forwards FakeProvider's
``x-fake-tokens``, ``x-fake-rate`` and ``x-fake-first-token-delay`` headers beside the
caller's. FakeProvider runs in this process. The clients live in groups of
``--group-size``, each group a network namespace joined to the machine by a veth pair, about
half of them shaped with tbf to a rate between 64 kbit/s and 5 Mbit/s (what the gateway
sends them), the rest at full speed.

Each client draws (from ``--seed``; one JSON line each to ``--log``): a replica, a route
(``/v1/chat/completions``, policy cancel, or ``/v1/reports``, policy detach), a short chat
(20-80 tokens) or a long report (300-900), a token rate, and a behaviour: ``read`` (to the
end), ``hangup-before`` (FIN once the response head arrived, before the first token),
``hangup-after`` (FIN after some tokens), ``stall`` (stops reading for 3-8 s, then reads
to the end) or ``retry`` (FIN after some tokens, then the same request with the same
Idempotency-Key, read to the end). Every request carries an Idempotency-Key and the client's
tag in the body's ``user``, so the provider's own records say which client each upstream
call served.

The figures come from the provider's counts (tokens generated per call), the clients'
receipts (tokens in whole events read from the socket) and the store's usage table, never
from the package's records alone:

- billed / delivered output tokens on the cancel route, overall and per kind (behaviour and
  link); the detach route beside it;
- usage records per generation (exactly one is the contract), each record's delivered
  tokens against the client's receipt;
- detached generations started against completed (the store's generations, and the
  provider's calls that finished after their client left);
- upstream runs per Idempotency-Key, and whether two ever overlapped.

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
from ._uvicorn import ROOT

GATEWAY = Path(ROOT) / "examples" / "gateway.py"
STORE_LINE = 'connect("sqlite:///generations.db")'
FORWARD_LINE = '"openai-project")'
FAKE_HEADERS = ("x-fake-tokens", "x-fake-rate", "x-fake-first-token-delay")
BEHAVIOURS = ("read", "hangup-before", "hangup-after", "stall", "retry")
WEIGHTS = (0.4, 0.12, 0.18, 0.15, 0.15)
TOKEN = re.compile(rb'"content": ?"tok\d+ ')
SETTLE = 20.0
TAKEOVER_LINES = (
    (
        "idle_timeout=60)",
        'idle_timeout=60, upstream="openai", continuation="continue_final_message")',
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
        cut = rng.randint(1, max(1, tokens // 2))
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
                first_token_delay=round(rng.uniform(1.0, 3.0), 2)
                if behaviour == "hangup-before"
                else 0.0,
                hangup_after_tokens=cut if behaviour in ("hangup-after", "retry") else None,
                stall_after_tokens=cut if behaviour == "stall" else None,
                stall_seconds=round(rng.uniform(3, 8), 2) if behaviour == "stall" else None,
                retry_wait=round(rng.uniform(0.3, 2.0), 2) if behaviour == "retry" else None,
                key=f"soak-{args.seed}-{client}-{rng.getrandbits(32):08x}",
            )
        )
    return rates, draws


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
) -> Attempt:
    """One HTTP/1.1 request from ``group``'s host, read as ``draw`` says."""
    loop = asyncio.get_running_loop()
    result = Attempt()
    sock = group.socket()
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
    request = f"POST {draw.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
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
        if length is not None:
            decoded.extend(data)
            result.complete = len(decoded) >= length
        else:
            decoded.extend(dechunk.feed(data))
            result.complete = dechunk.done
        result.bytes = len(decoded)
        if result.bytes and result.first_byte_at is None:
            result.first_byte_at = time.monotonic()
        result.tokens = _count_tokens(bytes(decoded))
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

    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, request.encode() + b"\r\n" + body)
            result.sent_at = time.monotonic()
            while not result.complete:
                data = await loop.sock_recv(sock, 65536)
                if not data:
                    break
                feed(data)
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
        hang_up()
        return result
    except OSError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    sock.close()
    return result


async def client(
    draw: Draw,
    group: _soak_net.Group,
    ports: list[int],
    started: float,
    deadline: float,
) -> list[Attempt]:
    await asyncio.sleep(max(0.0, started + draw.start - time.monotonic()))
    address = (_soak_net.PREFIX + ".0.1", ports[draw.replica])
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
        )
    ]
    if draw.behaviour != "retry" or attempts[0].cut_at_deadline:
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
        if again.status != 409:
            break
        await asyncio.sleep(min(5.0, again.retry_after or 1.0))
    return attempts


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
        command = [sys.executable, "-m", "uvicorn", "gateway:app", "--host", host]
        command += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
        command += ["--loop", "asyncio", "--http", "h11"]
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
                return proc
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica} did not start: see {log.name}")
            time.sleep(0.05)

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
    return {"usage": usage, "infos": infos, "rows": rows}


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
        "generations_in_store": len(stored["infos"]),
        "records_per_generation_in_usage_table": dict(sorted(table.items())),
        "stored_generations_without_record": sum(
            1 for info in stored["infos"] if info.id not in stored["rows"]
        ),
        "upstream_calls": len(provider.requests),
        "delivered_bytes_record_vs_received": byte_match,
        "delivered_record_vs_receipt": matches,
        "output_record_vs_provider": billed_vs_record,
        "usage_sources": dict(sources),
        "differences": differences[:20],
        "byte_differences": byte_differences[:20],
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
    out["clients"] = {
        "errors": sum(1 for r in results for a in r if a.error),
        "cut_at_deadline": sum(1 for r in results for a in r if a.cut_at_deadline),
        "statuses": dict(collections.Counter(str(a.status) for r in results for a in r)),
        "upstream_calls_open_after_settle": open_calls,
    }
    return out


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
        f"{u['delivered_bytes_record_vs_received']}",
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
    return "\n".join(lines)


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
            watch.stop()
            stop_gateways(procs)
            seen = sorted(
                {a.generation_id for r in results for a in r if a.generation_id and not a.replayed}
            )
            stored = asyncio.run(read_store(store, seen, schema))
            claims = asyncio.run(_soak_targets.claim_statuses(store, schema))
            fig = figures(draws, results, provider, stored, open_calls)
            fig["targets"] = {
                "keys_rerun_after_completion": _soak_targets.reruns_after_completion(provider),
                "claims": claims,
            }
            fig["replica_events"] = events.events
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
            fig["gateway_log_errors"] = {
                Path(log.name).name: sum(
                    1
                    for line in Path(log.name).read_text(errors="replace").splitlines()
                    if "Traceback" in line or "ERROR" in line
                )
                for log in logs
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
        print(f"targets: {fig['targets']}; violated: {_soak_targets.violated(fig) or 'none'}")
        if args.json:
            fig["args"] = {k: v for k, v in vars(args).items()}
            fig["group_rates_kbit"] = rates
            Path(args.json).write_text(json.dumps(fig, indent=2, default=str))
        return 0
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
