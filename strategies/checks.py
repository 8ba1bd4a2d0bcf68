"""Typed config sections and the rules OmegaConf cannot state.

A config section is a dataclass (an OmegaConf structured config): the library checks types,
``Literal`` choices, unknown and missing keys. Numeric ranges are field metadata declared with
:func:`positive`, :func:`nonnegative`, :func:`fraction`, :func:`unit_interval` and
:func:`below_one` and checked by :func:`check_ranges` (on list fields: every element); every
float must be finite. Rules that relate several keys stay code: :func:`require`.
Every error names the dotted key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from task.errors import ConfigError

RANGE = "range"  # the field metadata key of a Range


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers; ``name`` is how an error message says it."""

    low: float
    high: float
    low_open: bool
    high_open: bool
    name: str  # e.g. "positive", "in (0, 1]"

    def holds(self, value: float) -> bool:
        """Whether ``value`` lies in the interval."""
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below


POSITIVE = Range(0.0, math.inf, True, True, "positive")
NONNEGATIVE = Range(0.0, math.inf, False, True, ">= 0")
FRACTION = Range(0.0, 1.0, True, False, "in (0, 1]")
UNIT_INTERVAL = Range(0.0, 1.0, False, False, "in [0, 1]")
BELOW_ONE = Range(0.0, 1.0, False, True, "in [0, 1)")


def _ranged(bounds: Range, default: Any) -> Any:
    return dataclasses.field(default=default, metadata={RANGE: bounds})


def positive(default: Any = MISSING) -> Any:
    """A field whose value (or every element) is > 0."""
    return _ranged(POSITIVE, default)


def nonnegative(default: Any = MISSING) -> Any:
    """A field whose value (or every element) is >= 0."""
    return _ranged(NONNEGATIVE, default)


def fraction(default: Any = MISSING) -> Any:
    """A field in (0, 1]."""
    return _ranged(FRACTION, default)


def unit_interval(default: Any = MISSING) -> Any:
    """A field in [0, 1]."""
    return _ranged(UNIT_INTERVAL, default)


def below_one(default: Any = MISSING) -> Any:
    """A field in [0, 1) (momentum, Adam's betas)."""
    return _ranged(BELOW_ONE, default)


def one_of(names: tuple[str, ...]) -> Any:
    """A ``Literal`` type of ``names`` (choices held in a tuple, or known only at run time)."""
    return typing.Literal[names]  # type: ignore[valid-type]


def require(ok: bool, key: str, message: str) -> None:
    """Raise ``key: message`` unless ``ok`` (a rule across keys, or one a type cannot state)."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


# -- what a field allows, in words ---------------------------------------------------------------
def _strip_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


def describe(tp: Any, bounds: Range | None = None) -> str:
    """What a field of type ``tp`` (with ``bounds``) allows, e.g. "a positive integer",
    "null or a number in [0, 1)", "one of sgd, exact", "a list of numbers >= 0"."""
    tp, optional = _strip_optional(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        text = "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    elif origin in (list, typing.List):
        (item,) = typing.get_args(tp) or (Any,)
        text = "a list of " + _plural(describe(item, bounds))
    elif tp is bool:
        text = "true or false"
    elif tp in (int, float):
        noun = "integer" if tp is int else "number"
        if bounds is None:
            text = f"an {noun}" if tp is int else "a finite number"
        elif bounds.name == "positive":
            text = f"a positive {noun}"
        else:
            text = f"an {noun} {bounds.name}" if tp is int else f"a number {bounds.name}"
    elif tp is str:
        text = "a string"
    else:
        text = "a value"
    return f"null or {text}" if optional else text


def _plural(text: str) -> str:
    for article in ("an ", "a "):
        if text.startswith(article):
            words = text[len(article):].split(" ")
            noun = next(i for i, w in enumerate(words) if w in ("integer", "number", "string", "value"))
            words[noun] += "s"
            return " ".join(words)
    return text


# -- checking a merged config against its schema ---------------------------------------------------
def allowed_at(schema: type, key: str) -> str | None:
    """What the dotted ``key`` of ``schema`` allows, in words (None for a key it lacks)."""
    node: Any = schema
    tp, bounds = None, None
    for part in key.split("."):
        name, _, index = part.partition("[")
        node, _ = _strip_optional(node)
        if not dataclasses.is_dataclass(node):
            return None
        fields = {f.name: f for f in dataclasses.fields(node)}
        if name not in fields:
            return None
        tp, bounds = typing.get_type_hints(node)[name], fields[name].metadata.get(RANGE)
        if index:  # an element of a list field
            tp = (typing.get_args(_strip_optional(tp)[0]) or (Any,))[0]
        node = tp
    return describe(tp, bounds)


def check_ranges(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    """Every ranged field of ``schema`` in ``cfg`` lies in its range, and every float is finite."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        value = cfg[f.name]
        inner, _ = _strip_optional(tp)
        if dataclasses.is_dataclass(inner):
            if value is not None:
                check_ranges(value, inner, f"{key}.")
            continue
        bounds = f.metadata.get(RANGE)
        values = list(value) if OmegaConf.is_list(value) else [value]
        for item in values:
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                continue
            ok = math.isfinite(item) and (bounds is None or bounds.holds(item))
            require(ok, key, f"got {_shown(value)}, expected {describe(tp, bounds)}")


def _shown(value: Any) -> str:
    return repr(OmegaConf.to_container(value)) if OmegaConf.is_config(value) else repr(value)
