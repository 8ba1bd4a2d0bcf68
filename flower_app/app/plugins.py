"""Plug-ins: algorithms (or protocols) defined outside this app, imported by every process that
reads a run's configuration (the ServerApp, each simulation worker, each deployed ClientApp).

Two ways in: the run's ``plugins`` key (module names importable on ``PYTHONPATH``), and the
``flrep.algorithms`` entry points of installed packages, loaded whenever the package is installed.
A plug-in module registers what it defines when imported (``strategies.register``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points

from task.errors import ConfigError

ENTRY_POINT_GROUP = "flrep.algorithms"
_imported: set[str] = set()


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Import the installed entry points (once per process), then ``modules``; a plug-in that
    cannot be imported is a ConfigError naming it."""
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.value in _imported:
            continue
        try:
            point.load()
        except Exception as exc:  # noqa: BLE001 - any failure of a plug-in's own code
            raise ConfigError(f"plug-in entry point {point.name} = {point.value!r} (group {ENTRY_POINT_GROUP}, "
                              f"package {point.dist.name if point.dist else '?'}) cannot be loaded ({_why(exc)})") from None
        _imported.add(point.value)
    for module in modules:
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - not found, or the plug-in's own error
            raise ConfigError(f"plugins: cannot import {module!r} ({_why(exc)}); a plug-in module must be importable "
                              f"on PYTHONPATH or from the current directory (this process: {sys.executable})") from None
        _imported.add(module)
