"""Checkpoints and exported models load with ``weights_only=True``: a crafted pickle is refused,
naming the file and the object, and nothing in it runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flower_app.app import checkpoint
from flower_app.tools.export import load_model
from task.errors import ConfigError
from task.files import UnsafeFile, load_torch, save_torch_atomic


class _Payload:
    """Unpickling it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _crafted(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": checkpoint.FORMAT, "round": 1, "x": _Payload(marker)}, path)
    return path


def test_what_flrep_writes_loads(tmp_path):
    state = {"arrays": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "rng": np.random.get_state(),
             "t": torch.ones(2), "plain": {"a": [1, 2.5, "s", None]}}
    save_torch_atomic(state, tmp_path / "ok.pt")
    back = load_torch(tmp_path / "ok.pt")
    np.testing.assert_array_equal(back["arrays"]["w"], state["arrays"]["w"])
    np.testing.assert_array_equal(back["rng"][1], state["rng"][1])
    assert back["plain"] == state["plain"] and torch.equal(back["t"], state["t"])


def test_a_crafted_pickle_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = _crafted(tmp_path / "evil.pt", marker)
    with pytest.raises(UnsafeFile, match=r"evil\.pt: refused: it holds a Python object that loading would run \(getattr\)"):
        load_torch(path)
    assert not marker.exists()


def test_a_crafted_server_checkpoint_is_refused_at_resume(tmp_path):
    marker = tmp_path / "ran"
    _crafted(checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.SERVER_FILE, marker)
    with pytest.raises(ConfigError, match=r"^resume=.*server\.pt: refused: it holds a Python object"):
        checkpoint.read(tmp_path / "run", "resume='run'")
    assert not marker.exists()


def test_a_crafted_model_file_is_refused_by_load_model(tmp_path):
    marker = tmp_path / "ran"
    path = _crafted(tmp_path / "model.pt", marker)
    with pytest.raises(ConfigError, match=r"model\.pt: .*refused: it holds a Python object"):
        load_model(path)
    assert not marker.exists()
