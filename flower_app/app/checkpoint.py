"""Round checkpoints of the ServerApp and resuming a run from them.

At the end of every round the server writes ``<out_dir>/checkpoint/server.pt`` (atomically):
its ``format``, the global arrays, the strategy's state as plain data (its ``state_dict``:
SCAFFOLD's c, server-optimizer moments, TCT's standardisation, LG's phase ...; sets of node
ids are stored as partition ids, because node ids change between runs), the round, how many lines of ``metrics.jsonl`` the
run had written (a resumed run keeps those and drops the rest), the traffic so far, the
run's token (naming its clients' snapshot folders) and the RNG states. Client sampling is a
pure function of (seed, round), so the sequence continues by itself; the sampled clients of
every past round are in the records.

Clients snapshot their own state after each training message (see
:mod:`flower_app.app.client_checkpoint`); a resumed run's handshake tells them which round to
restore.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from omegaconf import DictConfig, OmegaConf

from task.errors import ConfigError
from task.files import UnsafeFile, load_torch, save_torch_atomic

SERVER_FILE = "server.pt"
#: The folder of the clients' snapshots in ``flrep run``'s simulation (removed when the run completes).
CLIENT_SNAPSHOTS = "clients"
#: The layout of ``server.pt``; a checkpoint of another format is refused, never guessed at.
FORMAT = 3
#: Keys that may differ between a run and its resumption (where and how it runs, not what).
MAY_DIFFER = ("resume", "out_dir", "wandb", "faults", "simulation", "client_state")
#: Paths resolved on each machine (in its data home): the same data where the last name agrees.
MAY_MOVE = ("data.root",)


def checkpoint_dir(out_dir: Path) -> Path:
    """Where a run directory keeps its checkpoints."""
    return out_dir / "checkpoint"


def resumable(out_dir: Path) -> bool:
    """``out_dir`` holds something ``resume=`` can continue: a server checkpoint, in it or in a
    comparison's variant folder, or a variant that completed."""
    folders = _run_folders(out_dir)
    return any((checkpoint_dir(f) / SERVER_FILE).is_file() for f in folders) or any(
        _completed(f / "summary.json") for f in folders[1:])


def elapsed_minutes(out_dir: Path) -> float:
    """Training and evaluation minutes the checkpoints in ``out_dir`` (and in a comparison's variant
    folders) have already spent; 0 where there is none or it cannot be read."""
    seconds = 0.0
    for folder in _run_folders(out_dir):
        try:
            seconds += float(read(folder, "checkpoint")["elapsed_s"])
        except (ConfigError, KeyError, TypeError, ValueError):
            continue
    return seconds / 60


def _run_folders(out_dir: Path) -> list[Path]:
    """``out_dir`` and its sub-folders (a comparison's variants); none where it does not exist."""
    return [out_dir, *(p for p in out_dir.iterdir() if p.is_dir())] if out_dir.is_dir() else []


def _completed(summary: Path) -> bool:
    try:
        return json.loads(summary.read_text()).get("status") == "completed"
    except (OSError, ValueError):
        return False


def save(out_dir: Path, state: dict[str, Any]) -> Path:
    """Write the server checkpoint ``state`` atomically; its path."""
    path = checkpoint_dir(out_dir) / SERVER_FILE
    state = dict(state, format=FORMAT, rng={"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()})
    save_torch_atomic(state, path)
    return path


def read(run_dir: Path, key: str) -> dict[str, Any]:
    """The server checkpoint of ``run_dir`` as written; errors name ``key`` and the file."""
    path = checkpoint_dir(run_dir) / SERVER_FILE
    if not path.is_file():
        raise ConfigError(f"{key}: no checkpoint there (expected {path})")
    try:
        state = load_torch(path)
    except UnsafeFile as err:
        raise ConfigError(f"{key}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: name it
        raise ConfigError(f"{key}: {path} cannot be read ({type(err).__name__}: {err}); "
                          "it is truncated or not a flrep checkpoint") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{key}: {path} is not a flrep checkpoint")
    if state.get("format") != FORMAT:
        raise ConfigError(f"{key}: {path} is a checkpoint of format {state.get('format', 1)}, "
                          f"this flrep reads format {FORMAT}; use the flrep version that wrote it")
    return state


def load(resume_dir: Path, cfg: DictConfig) -> dict[str, Any]:
    """The checkpoint of ``resume_dir`` after checking that it belongs to the same run config;
    restores the RNG states."""
    state = read(resume_dir, f"resume={str(resume_dir)!r}")
    differing = config_differences(state["config"], cfg)
    if differing:
        raise ConfigError(f"resume={str(resume_dir)!r}: the checkpoint was written with other values of "
                          f"{', '.join(differing[:10])}; resume with the run's own configuration")
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return state


def saved_records(resume_dir: Path, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The records the checkpointed round had written: the first lines of ``metrics.jsonl``."""
    path = resume_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    count = int(state["records_count"])
    if len(lines) < count:
        raise ConfigError(f"resume={str(resume_dir)!r}: {path} holds {len(lines)} records, the checkpoint of round "
                          f"{state['round']} was written after {count}")
    return [json.loads(line) for line in lines[:count]]


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data (for the checkpoint)."""
    return OmegaConf.to_container(cfg, resolve=True)


def config_differences(saved: dict[str, Any], cfg: DictConfig) -> list[str]:
    """Dotted keys whose values differ between a saved run config and ``cfg``. A key the saved
    config lacks was added to the app after that run was written, and counts as its default
    (:func:`flower_app.run.config.base_defaults`). ``data.root`` may sit in another data home."""
    from flower_app.run.config import base_defaults

    saved = _with_defaults(saved, base_defaults())
    now = plain_config(cfg)
    out: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if not prefix and key in MAY_DIFFER:
                    continue
                walk(a.get(key), b.get(key), f"{prefix}{key}.")
        elif a != b and not (prefix.rstrip(".") in MAY_MOVE and _same_name(a, b)):
            out.append(prefix.rstrip("."))

    walk(saved, now, "")
    return out


def _same_name(a: Any, b: Any) -> bool:
    """Two paths ending in the same file or folder name (the same data in another place)."""
    return isinstance(a, str) and isinstance(b, str) and Path(a).name == Path(b).name


def _with_defaults(saved: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with the keys it lacks, at any depth, taken from ``defaults``."""
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = _with_defaults(out[key], value)
    return out


def arrays_state(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    """The global arrays as numpy (bit-exact)."""
    return {k: a.numpy() for k, a in arrays.items()}
