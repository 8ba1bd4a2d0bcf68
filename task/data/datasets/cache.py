"""Atomic ``.npz`` caches of decoded arrays and the keys they are stored under."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
import zipfile
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
    """Load a cache ``.npz``; None if missing or unreadable.

    Members stored uncompressed (``np.savez``) of at least :data:`MMAP_MIN_BYTES` are
    memory-mapped copy-on-write: the processes of one machine that load the same cache share its
    pages (the operating system's file cache) until one writes to its copy, which then becomes
    private to that process. Smaller members are read into memory.
    """
    if not path.is_file():
        return None
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
            return {info.filename.removesuffix(".npy"): _member(path, zf, fh, info) for info in zf.infolist()}
    except Exception:  # noqa: BLE001 - a corrupt cache is just rebuilt
        return None


#: Members smaller than this are read into memory rather than memory-mapped.
MMAP_MIN_BYTES = 1 << 20


def _member(path: Path, zf: zipfile.ZipFile, fh, info: zipfile.ZipInfo) -> np.ndarray:
    """One ``.npy`` member of ``zf``: memory-mapped where stored uncompressed and large enough."""
    if info.compress_type == zipfile.ZIP_STORED and info.file_size >= MMAP_MIN_BYTES:
        fh.seek(info.header_offset)
        local = fh.read(30)  # the local file header: its name and extra-field lengths end it
        fh.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little"))
        version = np.lib.format.read_magic(fh)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is not None:
            shape, fortran, dtype = read_header(fh)
            if not dtype.hasobject and np.prod(shape) > 0:
                return np.memmap(path, dtype=dtype, mode="c", offset=fh.tell(), shape=shape,
                                 order="F" if fortran else "C")
    with zf.open(info) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


def hash_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def file_stamp(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]
