"""Options refused by name, when they are given, with the closest one that exists."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["refuse_unknown"]


def refuse_unknown(
    where: str, given: Iterable[str], target: Callable[..., Any], also: Iterable[str] = ()
) -> None:
    """Refuse an option ``target`` does not take (its keyword-only parameters, and
    ``also``), naming the closest one it does take."""
    known = [
        name
        for name, parameter in inspect.signature(target).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    known += also
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; one of {', '.join(known)}"
            raise TypeError(f"{where} got an unknown option {name!r}{hint}")
