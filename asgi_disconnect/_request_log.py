"""One log line per metered request, when its usage record is final.

The line goes to the ``asgi_disconnect.requests`` logger at INFO, as ``text`` (``key=value``
pairs after the id, method and route) or ``json`` (one object per line, the keys of
``FIELDS``). It is built only when that logger is enabled for INFO. Its ``end`` is the usage
record's ``outcome``, in the words of the generation's status and its error frame; what
stopped the work (``stopped_by``) and whether its client left (``disconnect_reason``) are
fields of their own (docs/architecture.md, "How a generation ended"). In ``text`` a token
count the package estimated (``usage_source="estimated"``) reads ``~72``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from ._contract import Outcome
    from ._records import UsageRecord

__all__ = ["FIELDS", "FORMATS", "REQUESTS", "check_format", "log_request"]

REQUESTS = logging.getLogger("asgi_disconnect.requests")
FORMATS = ("text", "json")
FIELDS = (
    "generation_id",
    "method",
    "route",
    "status_code",
    "policy",
    "end",
    "stopped_by",
    "disconnect_reason",
    "detached",
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
        "end": record.outcome,
        "stopped_by": record.stopped_by,
        "disconnect_reason": outcome.disconnect_reason if outcome is not None else None,
        "detached": record.detached,
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
    if values["stopped_by"] is not None:
        line.append(f"stopped_by={values['stopped_by']}")
    if values["disconnect_reason"] is not None:
        line.append(f"disconnect={values['disconnect_reason']}")
    if values["detached"]:
        line.append("detached=true")
    if values["error_type"] is not None:
        line.append(f"error={values['error_type']}")
    if values["model"] is not None:
        line.append(f"model={values['model']}")
    # An estimate says so where it is read: ``billed=~72``, not only ``usage=`` at the end.
    mark = "~" if values["usage_source"] == "estimated" else ""
    line.append(
        f"tokens in={_count(values['input_tokens'], mark)} "
        f"billed={_count(values['output_tokens'], mark)} "
        f"delivered={_count(values['delivered_output_tokens'], mark)} "
        f"usage={values['usage_source']}"
    )
    line.append(f"duration={values['duration']:.3f}s")
    return " ".join(line)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _count(value: int | None, mark: str) -> str:
    return "-" if value is None else f"{mark}{value}"


def log_request(form: str, record: UsageRecord, outcome: Outcome | None) -> None:
    """Log the request's line (``form``: ``text`` or ``json``); never raises."""
    try:
        values = fields(record, outcome)
        line = _encode(values).decode() if form == "json" else _text(values)
    except Exception:
        logging.getLogger("asgi_disconnect").exception("the request log line failed")
        return
    REQUESTS.info(line)
