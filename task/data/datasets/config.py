"""Validated reads of config values (``data.*`` keys and the like)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from task.errors import ConfigError

DEFAULT_CACHE_DIR = "~/.cache/flrep"


def cfg_get(cfg: Mapping | None, key: str, default: Any = None) -> Any:
    """``cfg[key]`` if present and not None, else ``default`` (works for DictConfig)."""
    if cfg is None:
        return default
    value = cfg.get(key, default)
    return default if value is None else value


def to_plain(obj: Any) -> Any:
    """Recursively convert Mappings/Sequences (e.g. OmegaConf containers) to dict/list."""
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, Sequence):
        return [to_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def get_int(cfg: Mapping | None, key: str, default: int | None, *, lo: int | None = None,
            hi: int | None = None, prefix: str = "data.") -> int | None:
    """Validated int config value; ``None`` stays None when the default is None."""
    value = cfg_get(cfg, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected an integer")
    value = int(value)
    if lo is not None and value < lo:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected an integer >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected an integer <= {hi}")
    return value


def get_float(cfg: Mapping | None, key: str, default: float, *, gt: float | None = None,
              ge: float | None = None, lt: float | None = None, prefix: str = "data.") -> float:
    """Validated finite float config value."""
    value = cfg_get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a finite number")
    if gt is not None and not value > gt:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a number > {gt}")
    if ge is not None and not value >= ge:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a number >= {ge}")
    if lt is not None and not value < lt:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a number < {lt}")
    return value


def get_bool(cfg: Mapping | None, key: str, default: bool, prefix: str = "data.") -> bool:
    value = cfg_get(cfg, key, default)
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected true or false")
    return bool(value)


def get_choice(cfg: Mapping | None, key: str, default: str, choices: Sequence[str],
               prefix: str = "data.") -> str:
    value = cfg_get(cfg, key, default)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{prefix}{key}={value!r} is invalid: expected one of {', '.join(choices)}"
        )
    return value


def cache_dir_from_cfg(data_cfg: Mapping | None) -> Path:
    value = cfg_get(data_cfg, "cache_dir", DEFAULT_CACHE_DIR)
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"data.cache_dir={value!r} is invalid: expected a directory path")
    return Path(os.path.expanduser(os.fspath(value)))
