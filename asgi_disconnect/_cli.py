"""``asgi-disconnect``: the demo gateway, and generations for operators.

    asgi-disconnect demo [--port 8000] [--upstream URL] [--backend URL]
    asgi-disconnect generations list [--status S] [--limit N] [--backend URL]
    asgi-disconnect generations show ID [--backend URL]
    asgi-disconnect generations tail ID [--offset N] [--backend URL]

``--backend`` defaults to ``$ASGI_DISCONNECT_BACKEND``, else the demo's SQLite file.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import secrets
import sys
from collections.abc import Sequence

import msgspec

from ._errors import BackendUnavailable

__all__ = ["main"]

DEFAULT_BACKEND = "sqlite:///demo-generations.db"
_KEY_VARIABLES = ("UPSTREAM_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asgi-disconnect", description="The demo gateway, and generations for operators."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="serve the demo gateway and its web page",
        description="Serve the demo gateway (FastAPI on the whole stack) and its web page, "
        "in front of FakeProvider on another loopback port, or of --upstream.",
    )
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument("--backend", default=None, help=f"backend URL (default {DEFAULT_BACKEND})")
    demo.add_argument(
        "--upstream",
        default=None,
        help="an OpenAI- or Anthropic-compatible base URL (https://api.openai.com); its key "
        "comes from $UPSTREAM_API_KEY, $OPENAI_API_KEY or $ANTHROPIC_API_KEY",
    )
    demo.add_argument("--model", default=None, help="the model the web page asks for")
    demo.add_argument("--tokens", type=int, default=200, help="FakeProvider: tokens per answer")
    demo.add_argument("--rate", type=float, default=20.0, help="FakeProvider: tokens per second")
    demo.add_argument(
        "--drain-token",
        default=None,
        help="the bearer token POST /drainz takes (default $ASGI_DISCONNECT_DRAIN_TOKEN, "
        "else a random one, printed)",
    )

    generations = commands.add_parser("generations", help="list, show and tail generations")
    actions = generations.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the newest generations")
    listing.add_argument(
        "--status", choices=["running", "complete", "failed", "cancelled", "interrupted"]
    )
    listing.add_argument("--limit", type=int, default=20)
    show = actions.add_parser("show", help="one generation's status and usage records")
    show.add_argument("id")
    tail = actions.add_parser("tail", help="a generation's bytes from --offset, live to its end")
    tail.add_argument("id")
    tail.add_argument("--offset", type=int, default=0)
    for sub in (listing, show, tail):
        sub.add_argument("--backend", default=None, help=f"backend URL (default {DEFAULT_BACKEND})")

    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    backend_url = args.backend or os.environ.get("ASGI_DISCONNECT_BACKEND") or DEFAULT_BACKEND
    problem = _missing_driver(backend_url)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        return asyncio.run(_generations(args, backend_url))
    except KeyboardInterrupt:
        return 130
    except (ValueError, BackendUnavailable) as exc:
        print(f"asgi-disconnect: {exc}", file=sys.stderr)
        return 2


def _missing_driver(url: str) -> str | None:
    if url.startswith(("postgresql://", "postgres://")) and not importlib.util.find_spec("asyncpg"):
        return "a postgresql:// backend needs asyncpg: pip install 'asgi-disconnect[postgres]'"
    return None


def _demo(args: argparse.Namespace) -> int:
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"the demo needs {', '.join(missing)}: pip install 'asgi-disconnect[demo]'",
            file=sys.stderr,
        )
        return 2
    backend_url = args.backend or os.environ.get("ASGI_DISCONNECT_BACKEND") or DEFAULT_BACKEND
    problem = _missing_driver(backend_url)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import uvicorn

    from .demo import make_app
    from .testing import FakeProvider

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
    url = f"http://{args.host}:{args.port}/"
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
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if provider is not None:
            provider.stop()
    return 0


async def _generations(args: argparse.Namespace, backend_url: str) -> int:
    from . import connect

    backend = connect(backend_url)
    await backend.open()
    try:
        if args.action == "list":
            for listed in await backend.recent(args.limit, args.status):
                print(
                    f"{listed.id}  {listed.status:<11} {listed.policy or '-':<7} "
                    f"{'detached' if listed.detached else '        '} {listed.size:>9} B  "
                    f"{listed.content_type or ''}"
                )
            return 0
        info = await backend.get(args.id)
        if info is None:
            print(f"no generation {args.id} in {backend_url}", file=sys.stderr)
            return 1
        if args.action == "show":
            usage = await backend.usage_of(args.id)
            print(
                msgspec.json.format(
                    msgspec.json.encode({"generation": info, "usage": usage}), indent=2
                ).decode()
            )
            return 0
        out = sys.stdout.buffer
        async for chunk in backend.follow(args.id, args.offset):
            out.write(chunk)
            out.flush()
        final = await backend.get(args.id)
        if final is not None and final.status != "complete":
            print(f"\n[{final.status}: {final.error or ''}]", file=sys.stderr)
        return 0
    finally:
        await backend.aclose()


if __name__ == "__main__":
    sys.exit(main())
