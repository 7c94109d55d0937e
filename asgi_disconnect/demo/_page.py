"""The demo's web page: rendered on the server, usable before any JavaScript arrives.

Without JavaScript the form posts to ``/ask`` and the answer is streamed into the page as
HTML. With it, the page streams ``/v1/reports`` (detach) or ``/v1/chat/completions``
(cancel) as SSE, keeps the generation id in the address, resumes after a reload or a lost
connection (event-aligned, ``Last-Event-ID``), stops the upstream with Stop
(``POST /generations/{id}/cancel``), shows the cost once the usage record is settled, and
polls the live panel. Three states: streaming, done (the protocol's terminal marker
arrived), failed (anything else: an error frame, a truncated or interrupted stream, a Stop).
"""

from __future__ import annotations

import html
from pathlib import Path

__all__ = ["page", "page_parts"]

_STYLE = """
body { font: 16px/1.5 system-ui, sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem; }
textarea { width: 100%; min-height: 4rem; font: inherit; }
pre#answer { white-space: pre-wrap; background: #f6f6f6; padding: 1rem; min-height: 6rem; }
.state { font-weight: 600; }
.state.streaming { color: #8a6d00; }
.state.done { color: #16702e; }
.state.failed { color: #b00020; }
#panel { border-top: 1px solid #ddd; margin-top: 1.5rem; font-size: 0.9rem; }
#panel dl { display: grid; grid-template-columns: max-content auto; gap: 0 1rem; }
button { font: inherit; padding: 0.3rem 1rem; }
"""

_LABELS = {"streaming": "Streaming…", "done": "Done.", "failed": "Failed."}

# The page's script, a file of its own beside this module.
_SCRIPT = (Path(__file__).parent / "page.js").read_text(encoding="utf-8")


def page_parts(
    *,
    prompt: str,
    generation_id: str | None = None,
    state: str = "idle",
    message: str = "",
    scripted: bool = True,
    model: str = "fake-model",
) -> tuple[str, str]:
    """The page around its answer: what comes before the answer's text, and after it."""
    label = message or _LABELS.get(state, "Ask something.")
    head = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>asgi-disconnect demo</title>
<style>{_STYLE}</style>
</head>
<body>
<header>
<h1>asgi-disconnect demo</h1>
<p>A gateway on the whole stack. Under <em>detach</em> the answer goes on if you leave:
reload the page mid-answer and it resumes. Under <em>cancel</em> leaving stops the provider.
Stop stops it either way.</p>
</header>
<main>
<form id="ask" method="post" action="/ask" data-model="{html.escape(model)}">
<label for="prompt">Prompt</label>
<textarea id="prompt" name="prompt">{html.escape(prompt)}</textarea>
<p><label><input type="checkbox" id="detach" checked> keep generating if I leave
(detach; unchecked: cancel)</label></p>
<button type="submit" id="send">Send</button>
<button type="button" id="stop" hidden>Stop</button>
</form>
<section id="result" data-state="{state}">
<p id="generation">{"Generation " + html.escape(generation_id) if generation_id else ""}</p>
<pre id="answer">"""
    tail = f"""</pre>
<p id="status" class="state {state}" data-state="{state}">{html.escape(label)}</p>
<p id="cost"></p>
</section>
<aside id="panel">
<h2>Live</h2>
<dl>
<dt>in flight</dt><dd id="stat-in_flight">-</dd>
<dt>cancelled</dt><dd id="stat-cancelled">-</dd>
<dt>detached</dt><dd id="stat-detached">-</dd>
<dt>detach completed</dt><dd id="stat-detach_completed">-</dd>
<dt>output tokens billed</dt><dd id="stat-billed_output_tokens">-</dd>
<dt>output tokens delivered</dt><dd id="stat-delivered_output_tokens">-</dd>
</dl>
</aside>
</main>
{"<script>" + _SCRIPT + "</script>" if scripted else ""}
</body>
</html>
"""
    return head, tail


def page(
    *,
    prompt: str,
    generation_id: str | None = None,
    answer: str = "",
    state: str = "idle",
    message: str = "",
    scripted: bool = True,
    model: str = "fake-model",
) -> str:
    head, tail = page_parts(
        prompt=prompt,
        generation_id=generation_id,
        state=state,
        message=message,
        scripted=scripted,
        model=model,
    )
    return head + html.escape(answer) + tail
