"""Config checks shared by the core and the algorithms' own sections: each raises a
:class:`~task.errors.ConfigError` that names the dotted key and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf

from task.errors import ConfigError


def require(ok: bool, key: str, message: str) -> None:
    """Raise ``key: message`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def positive(cfg: DictConfig, key: str, integer: bool = False, allow_none: bool = False) -> None:
    """``key`` is a positive number (integer-valued with ``integer``; null with ``allow_none``)."""
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return
    kind = "a positive integer" if integer else "a positive number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if integer:
        ok = ok and float(value).is_integer()
    require(ok, key, f"got {value!r}, expected {kind}")


def nonnegative(cfg: DictConfig, key: str) -> None:
    """``key`` is a number >= 0."""
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    require(ok, key, f"got {value!r}, expected a number >= 0")


def choice(cfg: DictConfig, key: str, allowed: Iterable[str]) -> None:
    """``key`` is one of ``allowed``."""
    allowed = tuple(allowed)
    value = OmegaConf.select(cfg, key)
    require(value in allowed, key, f"unknown value {value!r}; allowed: {', '.join(allowed)}")


def boolean(cfg: DictConfig, key: str) -> None:
    """``key`` is true or false."""
    value = OmegaConf.select(cfg, key)
    require(isinstance(value, bool), key, f"got {value!r}, expected true or false")
