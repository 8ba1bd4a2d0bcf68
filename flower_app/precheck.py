"""The checks a command can make in its first second, before torch and Flower are imported:
the experiment file, the overrides' form, keys unknown to ``conf/base.yaml``'s sections, and
that ``data.root`` and the output directory exist or can be made. Anything they let through is
checked in full afterwards (:func:`flower_app.config.load_variants` and the data itself).

Only plain YAML is read here, so a key of an algorithm's own section that ``conf/base.yaml``
does not list is left to the full check.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from flower_app.suggest import did_you_mean
from task.errors import ConfigError

APP_DIR = Path(__file__).resolve().parents[1]
CONF_DIR = APP_DIR / "conf"


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys")
    return data


def quick_check(experiment: str, overrides: Iterable[str]) -> None:
    """Raise a ConfigError naming the key or file for the mistakes that need no heavy import."""
    exp_path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    if not exp_path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
        raise ConfigError(f"experiment: unknown experiment '{experiment}'; available: {', '.join(names)}"
                          f"{did_you_mean(experiment, names)}")
    base = _read(CONF_DIR / "base.yaml")
    root = (_read(exp_path).get("data") or {}).get("root", (base.get("data") or {}).get("root"))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' must have the form key=value (e.g. train.lr=0.1)")
        parts = key.split(".")
        node, known = base, []
        for part in parts:
            if not isinstance(node, dict) or node is base and part not in base:
                break  # a section conf/base.yaml does not list: for the full check
            if part not in node:
                raise ConfigError(f"{key}: unknown key; {'.'.join(known) or 'the configuration'} has "
                                  f"{', '.join(node)}{did_you_mean(part, node, ''.join(f'{k}.' for k in known))}")
            node, known = node[part], [*known, part]
        if key == "data.root":
            root = value or None
    if isinstance(root, str) and root not in ("null", "None"):
        path = Path(root).expanduser()
        path = path if path.is_absolute() else APP_DIR / path
        if not path.exists():
            raise ConfigError(f"data.root={root!r} does not exist (looked for {path.resolve()})")
