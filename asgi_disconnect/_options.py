"""Options refused by name, when they are given, with the closest one that exists."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

__all__ = ["refuse_unknown", "refusing_unknown"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


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


def refusing_unknown(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function``, refusing a keyword it does not take as ``refuse_unknown`` does (the
    closest one named), where Python's own error would only say it is unexpected."""
    where = f"{function.__name__}()"

    @functools.wraps(function)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        refuse_unknown(where, kwargs, function)
        return function(*args, **kwargs)

    return checked
