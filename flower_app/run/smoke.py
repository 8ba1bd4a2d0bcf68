"""``smoke=true`` (``flrep run --smoke``): any experiment made short for a first look.

Every variant and every phase is cut down: 3 rounds, one local epoch, and what each algorithm
and protocol declares in its ``smoke`` hook (warm starts, stages, head epochs, +FT, new clients,
online rounds). The shortening is applied after each variant's own ``compare`` entry, so a
variant's own ``rounds=`` is shortened too. A smoke run's numbers say only that it runs; its
summary says ``smoke: true``. It is not judged on whether it learned (a few rounds need not beat
the clients' majority labels), but a diverged one (a NaN, an exploded loss) still fails.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

SMOKE_ROUNDS = 3
SMOKE_LOCAL_STEPS = 10


def _core(cfg: DictConfig) -> dict[str, Any]:
    """The core's keys: rounds, then local epochs (or steps)."""
    changes: dict[str, Any] = {"rounds": min(int(cfg.rounds), SMOKE_ROUNDS)}
    if cfg.train.local_steps is None:
        changes["train.local_epochs"] = min(int(cfg.train.local_epochs), 1)
    else:
        changes["train.local_steps"] = min(int(cfg.train.local_steps), SMOKE_LOCAL_STEPS)
    return changes


def smoke_changes(cfg: DictConfig) -> dict[str, Any]:
    """Key -> shortened value for one variant ``cfg`` (only the keys whose value changes): the
    core's, then its algorithm's and the protocols' hooks, which see the core's rounds."""
    from protocols import PROTOCOLS
    from strategies import ALGORITHMS

    changes = _core(cfg)
    short = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(short, key, value)
    algorithm = ALGORITHMS[cfg.algorithm]
    if algorithm.smoke is not None:
        changes.update(algorithm.smoke(short))
    for protocol in PROTOCOLS:
        changes.update(protocol.smoke(short))
    return {key: value for key, value in changes.items() if OmegaConf.select(cfg, key) != value}


def as_overrides(changes: Mapping[str, Any]) -> list[str]:
    """``key=value`` items OmegaConf reads back as the same values (None as ``null``)."""
    def text(value: Any) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return [f"{key}={text(value)}" for key, value in changes.items()]


def describe_smoke(experiment: str, overrides: Iterable[str]) -> list[str]:
    """One line per variant of a smoke run: its label and each shortened key as ``old -> new``."""
    from flower_app.run.config import load_variants

    def text(value: Any) -> str:
        return "null" if value is None else str(value)
    lines = []
    for cfg in load_variants(experiment, [*overrides, "smoke=false"]):
        changes = smoke_changes(cfg)
        lines.append(f"{cfg.label}: " + (", ".join(f"{key} {text(OmegaConf.select(cfg, key))} -> {text(value)}"
                                                   for key, value in changes.items()) or "already short"))
    return lines
