"""Keyword checks shared by the public entry points: a keyword nobody takes is an
ArgumentError naming the nearest one, not Python's TypeError naming an internal function."""
from __future__ import annotations

import difflib
import inspect
from typing import Any

from .errors import ArgumentError


def keywords_of(function: Any) -> list[str]:
    """The keywords `function` takes by name (not self, not its **catch-all)."""
    return [name for name, p in inspect.signature(function).parameters.items()
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_keywords(caller: str, unknown: dict, *takers: Any) -> None:
    """A keyword nobody takes is an ArgumentError naming the nearest one, not Python's
    TypeError naming an internal function."""
    if not unknown:
        return
    known = [name for taker in takers for name in keywords_of(taker)]
    name = next(iter(unknown))
    near = difflib.get_close_matches(name, known, n=1)
    raise ArgumentError(f"{caller} got an unknown keyword {name!r}" + (f"; did you mean {near[0]!r}?" if near else ".")
                        + f" It takes {', '.join(known)}.")
