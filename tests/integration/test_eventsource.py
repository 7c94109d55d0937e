"""A real WHATWG EventSource (Node's, which is undici's) resumes a generation and stops.

It cannot send Authorization, so it opens the stream with a resume token; it reads every
event once, reconnects when the stream ends (as the spec says it must), is answered 204
since it read the finished generation to its end, and stops for good.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, MemoryBackend
from asgi_disconnect.sse import SSEDecoder
from asgi_disconnect.testing import run_server

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = (Path(__file__).parents[1] / "data" / "openai_chat_basic.sse").read_bytes()
SCRIPT = """
const [url, wait] = process.argv.slice(2);
const source = new EventSource(url);
let opens = 0;
const events = [];
source.onopen = () => { opens += 1; };
source.onmessage = (event) => events.push([event.data, event.lastEventId]);
setTimeout(() => {
  console.log(JSON.stringify({ opens, events, state: source.readyState }));
  source.close();
  process.exit(0);
}, Number(wait));
"""


def node_with_eventsource() -> str | None:
    node = shutil.which("node")
    if node is None:
        return None
    probe = subprocess.run(
        [
            node,
            "--experimental-eventsource",
            "-e",
            "process.exit(typeof EventSource === 'function' ? 0 : 1)",
        ],
        capture_output=True,
        timeout=30,
    )
    return node if probe.returncode == 0 else None


NODE = node_with_eventsource()


@pytest.mark.skipif(NODE is None, reason="needs Node 20+ with --experimental-eventsource")
async def test_an_event_source_reads_every_event_once_and_stops(tmp_path: Path) -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for start in range(0, len(BODY), 50):
            yield BODY[start : start + 50]
            await asyncio.sleep(0)

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = DisconnectMiddleware(
        Starlette(routes=[Route("/chat", chat)]), backend=MemoryBackend(), keep_alive=None
    )
    script = tmp_path / "eventsource.js"
    script.write_text(SCRIPT)
    auth = {"authorization": "Bearer alice"}
    with run_server(app) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            first = await client.get("/chat", headers=auth)
            generation_id = first.headers["x-generation-id"]
            minted = await client.post(f"/generations/{generation_id}/token", headers=auth)
            token = minted.json()["token"]
        url = f"{server.url}/generations/{generation_id}/stream?token={token}"
        # undici reconnects 3 s after a stream ends: wait past that.
        done = await asyncio.to_thread(
            subprocess.run,
            [NODE, "--experimental-eventsource", "--no-warnings", str(script), url, "4500"],  # type: ignore[list-item]
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    original = [event.data for event in SSEDecoder().feed(BODY)]
    assert [data for data, _ in seen["events"]] == original
    assert seen["opens"] == 1, "it reconnected and was served again"
    assert seen["state"] == 2, "CLOSED: the 204 stopped it"
    # Its ids are offsets into the generation, the last one its end.
    assert seen["events"][-1][1] == str(len(BODY))
