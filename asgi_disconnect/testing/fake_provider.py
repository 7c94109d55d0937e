"""Run a FakeProvider in the foreground until Ctrl-C.

python -m asgi_disconnect.testing.fake_provider --host 127.0.0.1 --port 8001 --tokens 200 --rate 20
python -m asgi_disconnect.testing.fake_provider --fault reset-after=20     # every request resets
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading

from ._fake_provider import FakeProvider, Fault, logger

# Where it listens unless told: the demo's hint for a port taken never names it.
PROVIDER_PORT = 8001

_EPILOG = """\
routes:
  POST /v1/chat/completions   OpenAI Chat Completions ("stream": true for SSE, ending
                              with data: [DONE]; "stream_options": {"include_usage": true}
                              adds the usage chunk; max_tokens / max_completion_tokens cut)
  POST /v1/messages           Anthropic Messages (SSE ending with event: message_stop); a
                              final assistant message is a prefill that is continued
  POST /v1/responses          OpenAI Responses ("input"; "background": true runs on without
                              the client, kept --background-ttl seconds after it ends)
  GET  /v1/responses/{id}     the response object; ?stream=true&starting_after=N re-attaches
                              to a background response after sequence number N
  POST /v1/responses/{id}/cancel
                              cancel a background response
  GET  /health                200 "ok"

continuations (the answer is "tok0 tok1 ... tok{n-1} "; after a final assistant message
P it streams only what follows P, and bills P's tokens as input):
  "continue_final_message": true with "add_generation_prompt": false (vLLM, SGLang) on
  /v1/chat/completions; both true is vLLM's 400. Anthropic refuses a prefill ending in
  whitespace, with thinking enabled, or on a model that takes none (400).

per-request headers (override the options above for one request):
  x-fake-tokens: N            tokens in the response
  x-fake-rate: R              tokens per second (0 or inf: no delay)
  x-fake-first-token-delay: S seconds before the first token
  x-fake-error-after: N       the provider's mid-stream error frame after N tokens
  x-fake-fault: FAULT         a fault for this request only ("none": no fault)
  x-fake-queued: 1            a Responses API response stays queued for ever

faults (--fault or x-fake-fault; N past the token count means after the last token):
  reset-after=N               reset the connection (TCP RST, SO_LINGER 0) after N tokens
  stall-after=N[;seconds=S]   send nothing, socket open, after N tokens: for S seconds,
                              then go on; without seconds, until either side closes
  garbage-after=N             after N tokens send bytes that are no event stream, then end
  truncate-after=N            after N tokens end the chunked body cleanly, without the
                              finish, usage and terminal frames ([DONE] / message_stop)
  error-after=N               the provider's mid-stream error frame after N tokens
  status=CODE                 answer CODE (400-599) with the provider's JSON error body
                              (and retry-after for 429, 503, 529) instead of streaming

example:
  curl -N localhost:8001/v1/chat/completions -d '{"stream": true}' \\
       -H 'x-fake-fault: stall-after=5;seconds=3'
"""


def _fault(text: str) -> Fault | None:
    try:
        return Fault.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asgi_disconnect.testing.fake_provider",
        description="Fake OpenAI Chat Completions / Responses / Anthropic Messages SSE server.",
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=PROVIDER_PORT, help="0 picks a free port")
    parser.add_argument("--tokens", type=int, default=50, help="tokens per response")
    parser.add_argument(
        "--rate", type=float, default=200.0, help="tokens per second (0 or inf: no delay)"
    )
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--input-tokens", type=int, default=12, help="prompt tokens reported")
    parser.add_argument("--model", default="fake-model", help="model name in the responses")
    parser.add_argument(
        "--fault",
        type=_fault,
        default=None,
        metavar="FAULT",
        help="a fault for every request (see below); x-fake-fault overrides it per request",
    )
    parser.add_argument(
        "--background-ttl",
        type=float,
        default=600.0,
        help="seconds a Responses API response is kept after it ends",
    )
    args = parser.parse_args(argv)
    provider = FakeProvider(
        tokens=args.tokens,
        tokens_per_second=args.rate,
        first_token_delay=args.first_token_delay,
        input_tokens=args.input_tokens,
        model=args.model,
        fault=args.fault,
        host=args.host,
        port=args.port,
        background_ttl=args.background_ttl,
    )
    # A line per call when it ends: how many tokens, and whether its client left first.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    with provider:
        fault = "" if provider.fault is None else f"fault {provider.fault}; "
        print(f"FakeProvider listening on {provider.url} ({fault}Ctrl-C to stop)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
