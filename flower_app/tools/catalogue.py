"""The experiment catalogue (``conf/experiments.yaml``) and the lines ``flrep list`` prints.

The catalogue says what each experiment reproduces, its dataset and its estimated minutes; it
stays out of the run configuration, so no run's ``config.yaml`` holds it. ``flrep list`` reads
the algorithms' names and descriptions from the source of ``strategies/`` (:func:`builtin_algorithms`)
rather than importing them with torch, so it answers at once.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from task.errors import ConfigError

APP_DIR = Path(__file__).resolve().parents[2]
CATALOGUE = APP_DIR / "conf" / "experiments.yaml"
STRATEGIES_DIR = APP_DIR / "strategies"
FIELDS = ("reproduces", "dataset", "minutes_cpu", "minutes_gpu")


@dataclass(frozen=True)
class Entry:
    """One experiment: the paper setting it reproduces, its ``data.name``, and the estimated
    minutes of the whole ``flrep run`` (all variants, one seed) on 2 CPU cores and on a GPU (None: not measured)."""

    reproduces: str
    dataset: str
    minutes_cpu: float
    minutes_gpu: float | None


def load_catalogue(path: Path = CATALOGUE) -> dict[str, Entry]:
    """Experiment name -> :class:`Entry`; a ConfigError names the file and entry of a malformed one."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of experiment names")
    return {str(name): _entry(path, str(name), spec) for name, spec in raw.items()}


def _entry(path: Path, name: str, spec: object) -> Entry:
    if not isinstance(spec, dict) or set(spec) != set(FIELDS):
        raise ConfigError(f"{path}: {name}: expected the keys {', '.join(FIELDS)}, got {spec!r}")
    number = (int, float)
    if not (isinstance(spec["reproduces"], str) and isinstance(spec["dataset"], str)
            and isinstance(spec["minutes_cpu"], number) and isinstance(spec["minutes_gpu"], (*number, type(None)))):
        raise ConfigError(f"{path}: {name}: reproduces and dataset are text, minutes_cpu a number, "
                          f"minutes_gpu a number or null; got {spec!r}")
    return Entry(**spec)


def minutes(value: float | None) -> str:
    """A duration for a column: ``45 s``, ``67 min``, ``4.3 h``; ``-`` for None."""
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 60:.0f} s"
    return f"{value:.0f} min" if value < 100 else f"{value / 60:.1f} h"


def experiment_lines(names: Iterable[str], catalogue: Mapping[str, Entry]) -> list[str]:
    """A header, then one line per experiment: name, dataset, CPU and GPU estimates, what it reproduces."""
    lines = [f"  {'experiment':26s}{'dataset':17s}{'2-core CPU':>10s}{'GPU':>8s}  reproduces"]
    for name in names:
        entry = catalogue.get(name)
        if entry is None:
            lines.append(f"  {name:26s}(no entry in {CATALOGUE.name})")
            continue
        lines.append(f"  {name:26s}{entry.dataset:17s}{minutes(entry.minutes_cpu):>10s}"
                     f"{minutes(entry.minutes_gpu):>8s}  {entry.reproduces}")
    return lines


def algorithm_lines(descriptions: Mapping[str, str]) -> list[str]:
    """One line per algorithm: its ``algorithm=`` name and its description (with its paper)."""
    width = max((len(name) for name in descriptions), default=0) + 2
    return [f"  {name:{width}s}{text or '-'}" for name, text in descriptions.items()]


def builtin_algorithms(folder: Path = STRATEGIES_DIR) -> dict[str, str]:
    """Name -> description of each ``ALGORITHM = register(Algorithm(name=..., description=...))``
    in ``folder``'s modules, read from their source (sorted by name)."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Algorithm":
                fields = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
                if "name" in fields:
                    found[fields["name"]] = fields.get("description", "")
    return dict(sorted(found.items()))
