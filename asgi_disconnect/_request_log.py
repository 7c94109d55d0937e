"""One log line per metered request, when its usage record is final.

The line goes to the ``asgi_disconnect.requests`` logger at INFO, as ``text`` (``key=value``
pairs after the id, method and route) or ``json`` (one object per line, the keys of
``FIELDS``). It is built only when that logger is enabled for INFO.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from ._contract import Ending

if TYPE_CHECKING:
    from ._contract import Outcome
    from ._records import UsageRecord

__all__ = ["FIELDS", "FORMATS", "REQUESTS", "check_format", "how_it_ended", "log_request"]

REQUESTS = logging.getLogger("asgi_disconnect.requests")
FORMATS = ("text", "json")
FIELDS = (
    "generation_id",
    "method",
    "route",
    "status_code",
    "policy",
    "end",
    "disconnect_reason",
    "error_type",
    "model",
    "input_tokens",
    "output_tokens",
    "delivered_output_tokens",
    "usage_source",
    "delivery",
    "duration",
)
"""The keys of a ``json`` line, in order; a value not known is null."""

_encode = msgspec.json.Encoder().encode


def check_format(value: object) -> str | None:
    """``request_log``'s value: ``"text"``, ``"json"``, or None (no line)."""
    if value is None or value is False:
        return None
    if value not in FORMATS:
        raise ValueError(f"request_log must be 'text', 'json' or None, got {value!r}")
    return str(value)


def how_it_ended(record: UsageRecord, outcome: Outcome | None) -> str:
    """``complete``, ``cancelled`` (its client left, the policy cancelled), ``detached-…``
    (its client left, the work went on and ended so: ``detached-complete``), ``stopped``
    (its owner's Stop), ``drained`` (a drain's deadline), ``handed-over`` (left at a
    deadline to another replica, which finishes it), ``interrupted`` (a shutdown),
    ``cut`` (its client left once the work was done), else the record's ``outcome``
    (``truncated``, ``error``, ``unknown``)."""
    if outcome is not None:
        stopped = outcome.stopped_by
        if stopped == "owner":
            return "stopped"
        if stopped == "drain":
            return "drained"
        if stopped == "handover":
            return "handed-over"
        ending = outcome.ending
        if ending is Ending.CANCELLED:
            return "cancelled"
        if ending is Ending.INTERRUPTED:
            return "interrupted"
        if outcome.detached:
            return "detached-" + record.outcome
        if ending is Ending.CUT and record.outcome == "complete":
            return "cut"
    return record.outcome


def fields(record: UsageRecord, outcome: Outcome | None) -> dict[str, Any]:
    """The line's values, by ``FIELDS``."""
    status = record.status_code
    if outcome is not None and outcome.status is not None:
        status = outcome.status  # an answer DisconnectMiddleware sent itself included
    return {
        "generation_id": record.generation_id,
        "method": record.method,
        "route": record.route,
        "status_code": status,
        "policy": record.policy,
        "end": how_it_ended(record, outcome),
        "disconnect_reason": outcome.disconnect_reason if outcome is not None else None,
        "error_type": record.error_type,
        "model": record.model,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "delivered_output_tokens": record.delivered_output_tokens,
        "usage_source": record.usage_source,
        "delivery": record.delivery,
        "duration": round(record.duration, 3),
    }


def _text(values: dict[str, Any]) -> str:
    line = [
        str(values["generation_id"] or "-"),
        values["method"],
        values["route"],
        f"status={_or_dash(values['status_code'])}",
        f"policy={_or_dash(values['policy'])}",
        f"end={values['end']}",
    ]
    if values["disconnect_reason"] is not None:
        line.append(f"disconnect={values['disconnect_reason']}")
    if values["error_type"] is not None:
        line.append(f"error={values['error_type']}")
    if values["model"] is not None:
        line.append(f"model={values['model']}")
    line.append(
        f"tokens in={_or_dash(values['input_tokens'])} "
        f"billed={_or_dash(values['output_tokens'])} "
        f"delivered={_or_dash(values['delivered_output_tokens'])} "
        f"usage={values['usage_source']}"
    )
    line.append(f"duration={values['duration']:.3f}s")
    return " ".join(line)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def log_request(form: str, record: UsageRecord, outcome: Outcome | None) -> None:
    """Log the request's line (``form``: ``text`` or ``json``); never raises."""
    try:
        values = fields(record, outcome)
        line = _encode(values).decode() if form == "json" else _text(values)
    except Exception:
        logging.getLogger("asgi_disconnect").exception("the request log line failed")
        return
    REQUESTS.info(line)
