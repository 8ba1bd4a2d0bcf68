"""Atomic ``.npz`` caches of decoded arrays and the keys they are stored under."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

CACHE_VERSION = 1


def save_npz_atomic(path: Path, **arrays: np.ndarray) -> bool:
    """Write ``arrays`` to ``path`` atomically; return False (and warn) if impossible."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except OSError as exc:
        warnings.warn(f"could not write cache file {path}: {exc}", stacklevel=2)
        return False


def load_npz(path: Path) -> dict[str, np.ndarray] | None:
    """Load a cache ``.npz`` fully into memory; None if missing or unreadable."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except Exception:  # noqa: BLE001 - a corrupt cache is just rebuilt
        return None


def hash_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def file_stamp(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]
