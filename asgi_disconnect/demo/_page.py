"""The demo's web page: rendered on the server, whole without JavaScript.

The form posts to ``/ask``, which starts a generation on ``/v1/reports`` (detach, the box
checked) or ``/v1/chat/completions`` (cancel) and redirects to ``/?g={id}``: the page as the
generation stands, its status, its answer so far, its cost once the usage record is settled,
a Stop form while it runs; without JavaScript it reloads itself every second until there is
nothing more to show (under cancel, a page that stops reloading has left: the generation is
cancelled). With JavaScript the page
streams ``/v1/reports`` or ``/v1/chat/completions`` (cancel) itself, reads on through
``/generations/{id}/stream`` after a reload or a lost connection (``Last-Event-ID``), stops
with ``POST /generations/{id}/cancel``, and keeps the live panel and its chart up to date.
Four states: waiting (for the first token), streaming, done (the protocol's terminal
marker arrived), failed (an error frame, a truncated or interrupted stream, a Stop).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .. import UsageRecord

__all__ = [
    "ESTIMATED",
    "METERING",
    "RouteTokens",
    "View",
    "billed_estimated",
    "chart",
    "cost_line",
    "delivered_estimated",
    "render",
]

_STYLE = """
:root { --ink: #1d232b; --muted: #5b6675; --line: #dfe3e8; --card: #f7f8fa; }
body { font: 16px/1.5 system-ui, sans-serif; color: var(--ink); margin: 0 auto;
  max-width: 56rem; padding: 1rem 1.25rem 2rem; }
h1 { font-size: 1.5rem; margin: 0.5rem 0 0.25rem; }
header p { color: var(--muted); margin-top: 0; }
label[for=prompt] { font-weight: 600; }
textarea { box-sizing: border-box; width: 100%; min-height: 4rem; font: inherit;
  padding: 0.5rem; border: 1px solid var(--line); border-radius: 6px; }
.actions { display: flex; gap: 0.75rem; align-items: center; flex-wrap: wrap; }
button { font: inherit; padding: 0.35rem 1.1rem; border-radius: 6px; border: 1px solid #9aa5b1;
  background: #fff; cursor: pointer; }
#send { background: #1d4ed8; border-color: #1d4ed8; color: #fff; }
#stop { border-color: #b00020; color: #b00020; }
#result { margin-top: 1.25rem; border: 1px solid var(--line); border-radius: 8px;
  padding: 0.75rem 1rem; background: var(--card); }
.bar { display: flex; gap: 1rem; align-items: center; flex-wrap: wrap; }
.bar form { margin: 0 0 0 auto; }
#generation { color: var(--muted); font: 0.85rem ui-monospace, monospace; }
pre#answer { white-space: pre-wrap; background: #fff; border: 1px solid var(--line);
  border-radius: 6px; padding: 0.75rem; min-height: 5rem; margin: 0.75rem 0; }
pre#answer:empty::before { content: attr(data-empty); color: var(--muted); }
.state { font-weight: 600; margin: 0; padding: 0.1rem 0.6rem; border-radius: 999px;
  background: #eef0f3; }
.state::before { content: "●"; margin-right: 0.4rem; }
.state.waiting { color: #6b4fbb; } .state.waiting::before { animation: pulse 1s infinite; }
.state.streaming { color: #8a6d00; } .state.streaming::before { animation: pulse 0.6s infinite; }
.state.done { color: #16702e; }
.state.failed { color: #b00020; }
@keyframes pulse { 50% { opacity: 0.2; } }
#cost { margin: 0; color: var(--muted); font-size: 0.95rem; }
#panel { margin-top: 1.5rem; font-size: 0.9rem; display: grid; gap: 0 2rem;
  grid-template-columns: max-content 1fr; align-items: start; }
#panel h2 { grid-column: 1 / -1; font-size: 1.1rem; margin: 0 0 0.5rem; }
#panel dl { display: grid; grid-template-columns: max-content auto; gap: 0 1rem; margin: 0; }
#panel dd { margin: 0; font-variant-numeric: tabular-nums; }
#chart figcaption { color: var(--muted); }
#chart svg { max-width: 100%; height: auto; }
@media (max-width: 40rem) { #panel { grid-template-columns: 1fr; } }
"""

_LABELS = {"idle": "Ask something.", "waiting": "Waiting for the first token…"}
_STATS = (
    ("in_flight", "in flight"),
    ("cancelled", "cancelled"),
    ("detached", "detached"),
    ("detach_completed", "detach completed"),
    ("billed_output_tokens", "output tokens billed"),
    ("delivered_output_tokens", "output tokens delivered"),
)
METERING = "Cost: metering…"
# Before a figure that is an estimate, not a count.
ESTIMATED = "≈"

# The page's script, a file of its own beside this module.
_SCRIPT = (Path(__file__).parent / "page.js").read_text(encoding="utf-8")


@dataclass(frozen=True, kw_only=True)
class View:
    """What the page shows."""

    prompt: str
    model: str = "fake-model"
    generation_id: str | None = None
    state: str = "idle"  # idle, waiting, streaming, done, failed
    message: str = ""
    answer: str = ""
    offset: int = 0  # the generation's log bytes the answer was read from
    cost: str = ""
    chart: str = ""
    stats: dict[str, int] | None = None

    refresh: bool = False  # without JavaScript, reload: there is more to show soon
    detach: bool = True  # the policy asked for: the form's checkbox, checked

    @property
    def running(self) -> bool:
        return self.generation_id is not None and self.state in ("waiting", "streaming")


def _stop_form(view: View) -> str:
    hidden = "" if view.running else " hidden"
    value = html.escape(view.generation_id or "")
    return (
        f'<form id="stop-form" method="post" action="/stop"{hidden}>'
        f'<input type="hidden" name="g" value="{value}">'
        '<button type="submit" id="stop">Stop</button></form>'
    )


def render(view: View) -> str:
    label = view.message or _LABELS.get(view.state, "")
    status = (
        f'<p id="status" class="state {view.state}" data-state="{view.state}" '
        f'aria-live="polite">{html.escape(label)}</p>'
    )
    refresh = '<noscript><meta http-equiv="refresh" content="1"></noscript>\n'
    generation = f"Generation {view.generation_id}" if view.generation_id else ""
    stats = view.stats or {}
    cells = "".join(
        f'<dt>{title}</dt><dd id="stat-{key}">'
        f"{ESTIMATED if stats.get(key + '_estimated') else ''}{stats.get(key, '-')}</dd>"
        for key, title in _STATS
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{refresh if view.refresh else ""}<title>asgi-disconnect demo</title>
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
<form id="ask" method="post" action="/ask" data-model="{html.escape(view.model)}">
<label for="prompt">Prompt</label>
<textarea id="prompt" name="prompt">{html.escape(view.prompt)}</textarea>
<p class="actions"><button type="submit" id="send">Send</button>
<label><input type="checkbox" id="detach" name="detach"{" checked" if view.detach else ""}>
keep generating if I leave (detach; unchecked: cancel)</label></p>
</form>
<section id="result" data-state="{view.state}" data-offset="{view.offset}">
<div class="bar">
{status}
<span id="generation">{html.escape(generation)}</span>
{_stop_form(view)}
</div>
<pre id="answer" data-empty="The answer appears here.">{html.escape(view.answer)}</pre>
<p id="cost">{html.escape(view.cost)}</p>
</section>
<aside id="panel">
<h2>Live</h2>
<dl>{cells}</dl>
<figure id="chart">{view.chart}<figcaption>Output tokens per route: billed against
delivered. A working cancel keeps them close.</figcaption></figure>
</aside>
</main>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def billed_estimated(record: UsageRecord) -> bool:
    """The record's token counts are not the provider's: estimated from the text, or none."""
    return record.usage_source != "provider"


def delivered_estimated(record: UsageRecord, delivered: int | None) -> bool:
    """What reached the page, in tokens, is a share of the answer's, not a count: part of
    the answer (its text's share of the tokens), or of an estimated answer."""
    if not delivered:
        return False
    return billed_estimated(record) or delivered != record.output_tokens


_SOURCES = {
    "provider": "reported by the provider",
    "estimated": "estimated from the text, not reported by the provider",
    "none": "no usage known",
}


def cost_line(record: UsageRecord, delivered: int | None) -> str:
    """The usage record as the page says it, with what reached the page over its requests;
    a count that is an estimate is marked ≈."""

    def count(n: int | None, what: str, estimated: bool) -> str:
        if n is None:
            return f"unknown {what}"
        return f"{ESTIMATED if estimated else ''}{n} {what}"

    estimated = billed_estimated(record)
    source = _SOURCES.get(record.usage_source, record.usage_source)
    return (
        f"Cost: {count(record.input_tokens, 'input', estimated)} + "
        f"{count(record.output_tokens, 'output tokens', estimated)} ({source}), "
        f"{count(delivered, 'delivered to this page', delivered_estimated(record, delivered))}"
        f"; outcome {record.outcome}."
    )


@dataclass(frozen=True)
class RouteTokens:
    route: str
    billed: int
    delivered: int
    # Some of the route's figures are estimates, not counts: shown ≈.
    billed_estimated: bool = False
    delivered_estimated: bool = False


_ROW = 46


def chart(rows: list[RouteTokens]) -> str:
    """Billed against delivered output tokens, a pair of bars per route, as inline SVG."""
    width, left, right = 560, 170, 120
    height = len(rows) * _ROW + 30 if rows else 30
    scale = max([row.billed for row in rows] + [row.delivered for row in rows] + [1])
    span = width - left - right
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" '
        'aria-label="Output tokens billed and delivered, per route" '
        'font-family="system-ui, sans-serif" font-size="12">'
    ]
    if not rows:
        parts.append('<text x="0" y="20" fill="#5b6675">No output tokens yet.</text></svg>')
        return "".join(parts)
    for index, row in enumerate(rows):
        top = index * _ROW
        ratio = f"{row.billed / row.delivered:.2f}" if row.delivered else "n/a"
        parts.append(
            f'<g class="route" data-route="{html.escape(row.route)}" '
            f'data-billed="{row.billed}" data-delivered="{row.delivered}" '
            f'data-billed-estimated="{str(row.billed_estimated).lower()}" '
            f'data-delivered-estimated="{str(row.delivered_estimated).lower()}">'
            f'<text x="0" y="{top + 15}" fill="#1d232b">{html.escape(row.route)}</text>'
            f'<text x="0" y="{top + 31}" fill="#5b6675">billed/delivered {ratio}</text>'
        )
        bars = (
            (4, row.billed, row.billed_estimated, "#9aa5b1"),
            (22, row.delivered, row.delivered_estimated, "#2f7d4f"),
        )
        for offset, value, estimated, colour in bars:
            bar = round(span * value / scale)
            parts.append(
                f'<rect x="{left}" y="{top + offset}" width="{bar}" height="14" rx="2" '
                f'fill="{colour}"/><text x="{left + bar + 6}" y="{top + offset + 12}" '
                f'fill="#1d232b">{ESTIMATED if estimated else ""}{value}</text>'
            )
        parts.append("</g>")
    legend = height - 10
    parts.append(
        f'<rect x="{left}" y="{legend - 10}" width="10" height="10" fill="#9aa5b1"/>'
        f'<text x="{left + 14}" y="{legend}" fill="#5b6675">billed</text>'
        f'<rect x="{left + 70}" y="{legend - 10}" width="10" height="10" fill="#2f7d4f"/>'
        f'<text x="{left + 84}" y="{legend}" fill="#5b6675">delivered</text>'
    )
    if any(row.billed_estimated or row.delivered_estimated for row in rows):
        parts.append(
            f'<text x="{left + 160}" y="{legend}" fill="#5b6675">'
            f"{ESTIMATED} estimated, not counted</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
