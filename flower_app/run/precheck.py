"""The checks a command can make in its first second, before torch and Flower are imported:
the experiment file, the overrides' form, keys unknown to ``conf/base.yaml``'s sections, and
that the dataset's files are there (downloaded into the data home when they can be) and the
output directory exists or can be made. Anything they let through is
checked in full afterwards (:func:`flower_app.run.config.load_variants` and the data itself).

Only plain YAML is read here, so a key of an algorithm's own section that ``conf/base.yaml``
does not list is left to the full check.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from task.data.home import home_folder_of, missing_data_error, resolve_root
from flower_app.run.suggest import did_you_mean
from task.errors import ConfigError

APP_DIR = Path(__file__).resolve().parents[2]
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
    data = {**(base.get("data") or {}), **(_read(exp_path).get("data") or {})}
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
        if key in ("data.root", "data.name", "data.source"):
            data[key[5:]] = None if value in ("", "null", "None") else value
    ensure_data(data)


def ensure_data(data: dict) -> None:
    """The dataset's files are where ``data.root`` (or the data home) says, downloaded into the data
    home when a fetcher exists (:mod:`task.data.fetch`); else a ConfigError naming the folder."""
    if data.get("source", "local") != "local" or not isinstance(data.get("name"), str):
        return
    root = data.get("root")
    path = resolve_root(data["name"], root if isinstance(root, str) else None)
    if path is None or path.exists():
        return
    entry = home_folder_of(path)
    if entry is None or not entry.fetchable:
        raise missing_data_error(data["name"], path)
    from task.data.fetch import fetch_folder

    fetch_folder(entry.folder)
    if not path.exists():
        raise missing_data_error(data["name"], path)
