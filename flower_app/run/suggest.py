"""Did-you-mean hints for unknown names: keys, experiments, tables and choices.

Imports neither torch nor Flower, so the first-second checks (:mod:`flower_app.run.precheck`) use it too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from difflib import SequenceMatcher, get_close_matches
from typing import Any


def did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean `x`?"`` naming the candidate closest to ``word`` (and a second one about as
    close), each shown after ``prefix`` (e.g. a key's section); "" when none is close."""
    close = get_close_matches(word, list(candidates), n=2)
    if len(close) == 2 and _similarity(word, close[1]) < _similarity(word, close[0]) - 0.1:
        close = close[:1]
    return f"; did you mean {' or '.join(f'`{prefix}{name}`' for name in close)}?" if close else ""


def _similarity(word: str, candidate: str) -> float:
    """The ratio ``get_close_matches`` ranks by."""
    return SequenceMatcher(None, candidate, word).ratio()


def choices_at(schema: type, key: str) -> tuple[str, ...]:
    """The ``Literal`` choices of the dotted ``key`` of the dataclass ``schema`` (empty when it has none)."""
    tp: Any = schema
    for part in key.split("."):
        tp = _inner(tp)
        name = part.partition("[")[0]
        if not dataclasses.is_dataclass(tp) or name not in {f.name for f in dataclasses.fields(tp)}:
            return ()
        tp = typing.get_type_hints(tp)[name]
    tp = _inner(tp)
    return tuple(map(str, typing.get_args(tp))) if typing.get_origin(tp) is typing.Literal else ()


def _inner(tp: Any) -> Any:
    """``tp`` without ``Optional`` and list wrappers (the type of one value)."""
    while typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        tp = next(arg for arg in typing.get_args(tp) if arg is not type(None))
    return tp
