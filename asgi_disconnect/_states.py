"""Where one request stands: three questions, one enum each, and the moves each allows.

The exchange (``_disconnect._Exchange``) is the only writer of ``Stage`` and ``Client``;
the response's ``Delivery`` is the client writer's (the response side's for a response sent
in one piece). A move its table does not allow is a bug, raised naming both states
(``moved``). docs/architecture.md shows the same tables, and a test keeps them in step.
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = [
    "CLIENT_MOVES",
    "CLIENT_OF_REASON",
    "DELIVERY_MOVES",
    "MOVES",
    "Client",
    "Delivery",
    "Stage",
    "moved",
]


class Stage(enum.Enum):
    """Where the work of one request stands."""

    # Members are unique: hashed by identity, in C (Enum's own hash is Python code).
    __hash__ = object.__hash__

    RUNNING = "running"
    """The app runs; its client is there (or its response went whole)."""
    DETACHED = "detached"
    """The client left and the route detaches: the app runs on, owned by the process."""
    CANCELLING = "cancelling"
    """The app is being cancelled: its client left under cancel, its owner stopped it, a
    drain's deadline came, the server refused a send or cancelled the request."""
    SETTLING = "settling"
    """The app is over; the client's TCP has yet to acknowledge the rest it was handed."""
    ENDED = "ended"
    """The outcome is published (``RequestState.finish``); a Stop no longer reaches it."""


class Client(enum.Enum):
    """Where the request's client stands, as the exchange last heard."""

    __hash__ = object.__hash__

    CONNECTED = "connected"
    """Nothing says it left (a response it received whole included)."""
    GONE = "gone"
    """It closed the connection (FIN or RST), as the server says."""
    SILENT = "silent"
    """Its TCP acknowledged nothing for ``client_timeout``."""
    LAGGING = "lagging"
    """A send to it waited ``max_lag_seconds``."""
    REFUSED = "refused"
    """The server refused a send to it (a protocol error): the response is broken."""


class Delivery(enum.Enum):
    """Where the response stands with the client."""

    __hash__ = object.__hash__

    OPEN = "open"
    """Started; more is to come."""
    FINAL = "final"
    """The message that ends the response is being handed to the server."""
    DONE = "done"
    """The whole response was handed to the server."""
    GONE = "gone"
    """The client left, lagged or the server refused a send: nothing more is sent."""


MOVES: dict[Stage, frozenset[Stage]] = {
    Stage.RUNNING: frozenset({Stage.DETACHED, Stage.CANCELLING, Stage.SETTLING, Stage.ENDED}),
    Stage.DETACHED: frozenset({Stage.CANCELLING, Stage.SETTLING, Stage.ENDED}),
    Stage.CANCELLING: frozenset({Stage.SETTLING, Stage.ENDED}),
    Stage.SETTLING: frozenset({Stage.ENDED}),
    Stage.ENDED: frozenset(),
}
"""Each stage's next stages."""

CLIENT_MOVES: dict[Client, frozenset[Client]] = {
    Client.CONNECTED: frozenset({Client.GONE, Client.SILENT, Client.LAGGING, Client.REFUSED}),
    Client.GONE: frozenset(),
    Client.SILENT: frozenset(),
    Client.LAGGING: frozenset(),
    Client.REFUSED: frozenset(),
}
"""A client leaves once: what is heard of it afterwards changes nothing."""

DELIVERY_MOVES: dict[Delivery, frozenset[Delivery]] = {
    Delivery.OPEN: frozenset({Delivery.FINAL, Delivery.DONE, Delivery.GONE}),
    Delivery.FINAL: frozenset({Delivery.DONE, Delivery.GONE}),
    Delivery.DONE: frozenset(),
    Delivery.GONE: frozenset(),
}
"""Each delivery's next ones."""

# Why the exchange hears that its client left -> where the client stands then.
CLIENT_OF_REASON = {
    "client": Client.GONE,
    "silent": Client.SILENT,
    "lag": Client.LAGGING,
    "error": Client.REFUSED,
}

_State = TypeVar("_State", Stage, Client, Delivery)


def moved(table: dict[_State, frozenset[_State]], start: _State, to: _State) -> _State:
    """``to``, if ``table`` allows the move from ``start``; else a RuntimeError naming both."""
    if to not in table[start]:
        kind = type(start).__name__.lower()
        raise RuntimeError(f"the {kind} cannot go from {start.value} to {to.value}")
    return to
