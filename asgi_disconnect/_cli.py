"""``asgi-disconnect``: the demo gateway, and generations for operators.

    asgi-disconnect demo [--port 8000] [--upstream URL] [--backend URL]
    asgi-disconnect generations list [--status S] [--limit N] [--backend URL] [--create]
    asgi-disconnect generations show ID [--backend URL] [--create]
    asgi-disconnect generations tail ID [--offset N] [--backend URL] [--create]

``--backend`` defaults to ``$ASGI_DISCONNECT_BACKEND``, else the demo's SQLite file (one
that does not exist is refused, not created, unless ``--create`` asks for it). Bad input
exits 2 with one line that says what to do; a generation that is not there exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import math
import os
import secrets
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ._errors import BackendUnavailable

if TYPE_CHECKING:
    from ._records import GenerationInfo, UsageRecord

__all__ = ["main", "parser"]

DEFAULT_BACKEND = "sqlite:///demo-generations.db"
STATUSES = ["running", "complete", "failed", "cancelled", "interrupted"]
# What the demo imports, by the package that installs it (python-multipart: FastAPI's forms).
_DEMO_NEEDS = {
    "fastapi": ("fastapi",),
    "uvicorn": ("uvicorn",),
    "python-multipart": ("python_multipart", "multipart"),
}
_KEY_VARIABLES = ("UPSTREAM_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def parser() -> argparse.ArgumentParser:
    """The command line: every command, every option with its help."""
    main_parser = argparse.ArgumentParser(
        prog="asgi-disconnect", description="The demo gateway, and generations for operators."
    )
    commands = main_parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="demo, or generations"
    )
    demo = commands.add_parser(
        "demo",
        help="serve the demo gateway and its web page",
        description="Serve the demo gateway (FastAPI on the whole stack) and its web page, "
        "in front of FakeProvider on another loopback port, or of --upstream. Ctrl-C waits "
        "for the generations running (saying how many, and for how long); Ctrl-C again "
        "interrupts them, keeping what they produced.",
    )
    demo.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    demo.add_argument(
        "--port", type=_port, default=8000, help="the port to listen on (default 8000)"
    )
    demo.add_argument(
        "--backend",
        default=None,
        help=f"backend URL (default $ASGI_DISCONNECT_BACKEND, else {DEFAULT_BACKEND})",
    )
    demo.add_argument(
        "--upstream",
        default=None,
        help="an OpenAI- or Anthropic-compatible base URL (https://api.openai.com); its key "
        "comes from $UPSTREAM_API_KEY, $OPENAI_API_KEY or $ANTHROPIC_API_KEY",
    )
    demo.add_argument("--model", default=None, help="the model the web page asks for")
    demo.add_argument(
        "--tokens", type=_positive, default=200, help="FakeProvider: tokens per answer"
    )
    demo.add_argument("--rate", type=_rate, default=20.0, help="FakeProvider: tokens per second")
    demo.add_argument(
        "--drain-token",
        default=None,
        help="the bearer token POST /drainz takes (default $ASGI_DISCONNECT_DRAIN_TOKEN, "
        "else a random one, printed)",
    )

    generations = commands.add_parser(
        "generations",
        help="list, show and tail generations",
        description="Read the generations a backend stored. A SQLite file that does not "
        "exist is refused, not created, unless --create asks for it.",
    )
    actions = generations.add_subparsers(
        dest="action", required=True, metavar="ACTION", help="list, show or tail"
    )
    listing = actions.add_parser("list", help="the newest generations")
    listing.add_argument("--status", choices=STATUSES, help="only those with this status")
    listing.add_argument(
        "--limit", type=_positive, default=20, help="how many, newest first (default 20)"
    )
    show = actions.add_parser("show", help="one generation's status and usage records")
    show.add_argument("id", help="the generation's id (gen_...)")
    tail = actions.add_parser("tail", help="a generation's bytes from --offset, live to its end")
    tail.add_argument("id", help="the generation's id (gen_...)")
    tail.add_argument(
        "--offset", type=_non_negative, default=0, help="the first byte to print (default 0)"
    )
    for sub in (listing, show, tail):
        sub.add_argument(
            "--backend",
            default=None,
            help=f"backend URL (default $ASGI_DISCONNECT_BACKEND, else {DEFAULT_BACKEND})",
        )
        sub.add_argument(
            "--create",
            action="store_true",
            help="make the SQLite file (an empty store) if it is not there, instead of refusing",
        )
    return main_parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    backend_url = args.backend or os.environ.get("ASGI_DISCONNECT_BACKEND") or DEFAULT_BACKEND
    problem = _missing_driver(backend_url) or (
        None if args.create else _missing_database(backend_url)
    )
    if problem:
        print(f"asgi-disconnect: {problem}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_generations(args, backend_url))
    except KeyboardInterrupt:
        return 130
    except (ValueError, BackendUnavailable) as exc:
        print(f"asgi-disconnect: {exc}", file=sys.stderr)
        return 2


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _non_negative(text: str) -> int:
    number = _whole(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {number}")
    return number


def _positive(text: str) -> int:
    number = _whole(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {number}")
    return number


def _port(text: str) -> int:
    number = _whole(text)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {number}")
    return number


def _rate(text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (number > 0 and math.isfinite(number)):
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return number


def _missing_driver(url: str) -> str | None:
    if url.startswith(("postgresql://", "postgres://")) and not importlib.util.find_spec("asyncpg"):
        return "a postgresql:// backend needs asyncpg: pip install 'asgi-disconnect[postgres]'"
    return None


def _missing_database(url: str) -> str | None:
    """A SQLite file that is not there: reading it would create an empty one, and show
    nothing, where the operator meant another directory or another file."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "sqlite" or not rest.startswith("/") or rest == "/:memory:":
        return None
    path = Path(rest[1:]).absolute()
    if path.exists():
        return None
    return (
        f"no SQLite database at {path}: nothing was stored there. The demo writes "
        f"{Path(DEFAULT_BACKEND.partition(':///')[2])} in the directory it runs in; run this "
        "there, or pass --backend sqlite:////absolute/path.db (or set $ASGI_DISCONNECT_BACKEND)"
    )


def _missing_for_demo() -> str | None:
    """What the demo needs that is not installed, as the one command that installs it."""
    missing = [
        package
        for package, modules in _DEMO_NEEDS.items()
        if not any(importlib.util.find_spec(module) for module in modules)
    ]
    if not missing:
        return None
    return (
        f"the demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
        "not installed: pip install -e '.[demo]' in a clone of asgi-disconnect (bash scripts/demo "
        f"does it), else pip install {' '.join(missing)}"
    )


def _demo(args: argparse.Namespace) -> int:
    missing = _missing_for_demo()
    backend_url = args.backend or os.environ.get("ASGI_DISCONNECT_BACKEND") or DEFAULT_BACKEND
    problem = missing or _missing_driver(backend_url)
    if problem:
        print(f"asgi-disconnect: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    from .demo import make_app
    from .demo._logging import log_config
    from .demo._serve import CannotListen, DemoServer, listen
    from .testing import FakeProvider

    try:
        asyncio.run(_check_store(backend_url))
    except (ValueError, BackendUnavailable) as exc:
        print(f"asgi-disconnect: {exc}", file=sys.stderr)
        return 2
    try:
        sock = listen(args.host, args.port)
    except CannotListen as exc:
        print(f"asgi-disconnect: {exc}", file=sys.stderr)
        return 2
    with sock:
        port = sock.getsockname()[1]
        provider = None
        upstream = args.upstream
        api_key = next((os.environ[name] for name in _KEY_VARIABLES if os.environ.get(name)), None)
        if upstream is None:
            provider = FakeProvider(tokens=args.tokens, tokens_per_second=args.rate).start()
            upstream = provider.url
            where = f"FakeProvider on {upstream} ({args.tokens} tokens at {args.rate:g}/s)"
        else:
            where = upstream + ("" if api_key else " (no key in the environment)")
        model = args.model or ("fake-model" if provider is not None else "gpt-4o-mini")
        drain_token = (
            args.drain_token
            or os.environ.get("ASGI_DISCONNECT_DRAIN_TOKEN")
            or secrets.token_urlsafe(18)
        )
        app = make_app(
            upstream=upstream,
            backend_url=backend_url,
            api_key=api_key,
            model=model,
            drain_token=drain_token,
        )
        url = f"http://{args.host}:{port}/"
        print(
            f"asgi-disconnect demo\n"
            f"  open        {url}\n"
            f"  OpenAI      POST {url}v1/chat/completions   (cancel)\n"
            f"  Anthropic   POST {url}v1/messages           (cancel)\n"
            f"  reports     POST {url}v1/reports            (detach)\n"
            f"  upstream    {where}\n"
            f"  generations {backend_url}\n"
            f"  drain       POST {url}drainz  (authorization: Bearer {drain_token})\n"
            f"Ctrl-C stops it.",
            flush=True,
        )
        server = DemoServer(uvicorn.Config(app, log_level="warning", log_config=log_config()), app)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass  # uvicorn raises the Ctrl-C it handled again, once it stopped
        finally:
            if provider is not None:
                provider.stop()
        if not server.started:
            return 1  # uvicorn said why
    logging.getLogger("asgi_disconnect.demo").info("Stopped.")
    return 0


async def _check_store(backend_url: str) -> None:
    """Open the store and close it: one the demo cannot use is refused before its banner."""
    from . import connect

    backend = connect(backend_url)
    await backend.open()
    await backend.aclose()


async def _generations(args: argparse.Namespace, backend_url: str) -> int:
    from . import connect

    backend = connect(backend_url)
    await backend.open()
    try:
        if args.action == "list":
            listed = await backend.recent(args.limit, args.status)
            _print_list([(info, await backend.usage_of(info.id)) for info in listed])
            return 0
        info = await backend.get(args.id)
        if info is None:
            print(f"no generation {args.id} in {backend_url}", file=sys.stderr)
            return 1
        if args.action == "show":
            usage = await backend.usage_of(args.id)
            shown = {
                "generation": _with_iso_times(info, "created_at", "finished_at"),
                "usage": [_with_iso_times(record, "started_at") for record in usage],
            }
            print(msgspec.json.format(msgspec.json.encode(shown), indent=2).decode())
            return 0
        if args.offset > info.size and info.status != "running":
            return _past_the_end(args.offset, info.size)
        out = sys.stdout.buffer
        async for chunk in backend.follow(args.id, args.offset):
            out.write(chunk)
            out.flush()
        final = await backend.get(args.id)
        if final is not None and args.offset > final.size:
            return _past_the_end(args.offset, final.size)
        if final is not None and final.status != "complete":
            print(f"\n[{final.status}: {final.error or ''}]", file=sys.stderr)
        return 0
    finally:
        await backend.aclose()


_COLUMNS = (
    "ID", "STATUS", "POLICY", "ROUTE", "CREATED (UTC)", "BYTES", "OUTPUT TOKENS", "ATTEMPT",
    "OWNER",
)  # fmt: skip


def _print_list(rows: list[tuple[GenerationInfo, list[UsageRecord]]]) -> None:
    """One line a generation under a header: its route and output tokens are its usage
    records' (none while it runs); a count that is an estimate says so."""
    lines = [_COLUMNS]
    estimated = False
    for info, usage in rows:
        record = usage[-1] if usage else None
        tokens = "-"
        if record is not None and record.output_tokens is not None:
            tokens = str(sum(r.output_tokens or 0 for r in usage))
            if any(r.usage_source != "provider" for r in usage):
                tokens += " (estimated)"
                estimated = True
        policy = (info.policy or "-") + (", detached" if info.detached else "")
        lines.append(
            (
                info.id,
                info.status,
                policy,
                record.route if record is not None else "-",
                _readable(info.created_at),
                str(info.size),
                tokens,
                str(info.attempt),
                info.owner or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(_COLUMNS))]
    for line in lines:
        cells = [
            cell.rjust(width) if i in (5, 7) else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    if estimated:
        print(
            "(estimated): counted from the text, not reported by the provider "
            "(generations show ID: the record's usage_note says how)"
        )


def _readable(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds")


def _with_iso_times(record: msgspec.Struct, *names: str) -> dict[str, Any]:
    """``record`` as its JSON object, its Unix-second times as ISO 8601 (UTC)."""
    shown: dict[str, Any] = msgspec.to_builtins(record)
    for name in names:
        if name in shown:
            shown[name] = _iso(getattr(record, name))
    return shown


def _past_the_end(offset: int, size: int) -> int:
    # As the resume endpoint answers it (416, problem type offset-out-of-range).
    print(
        f"asgi-disconnect: Offset Out Of Range: offset {offset} is past the {size} bytes produced.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
