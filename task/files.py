"""Writes that are whole or absent: a failed write (a full disk above all) leaves the old file or
none, never a torn one or a temporary file, and its error names the path it was writing."""

from __future__ import annotations

import errno
import os
import pickle
import re
from pathlib import Path
from typing import NoReturn


#: The errnos of a full disk (or a full quota).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(OSError):
    """A file could not be written; its message names the file (``no space left on <path>``)."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_failed(err: BaseException, path: Path) -> WriteFailed | None:
    """``err``, raised while writing ``path``, as a :class:`WriteFailed` naming ``path``; None when
    no OSError caused it. torch's writer hides a full disk behind its own RuntimeError
    (``unexpected pos``): the OSError is then its context."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None or isinstance(cause, WriteFailed):
        return cause
    if cause.errno in DISK_FULL:
        return WriteFailed(cause.errno, f"no space left on {path}")
    return WriteFailed(cause.errno, f"could not write {path}: {cause.strerror or cause}")


def fail_cleanly(err: BaseException, path: Path, tmp: Path | None = None) -> NoReturn:
    """Remove ``tmp``, then raise ``err`` as :func:`write_failed` names it (as it is when no
    OSError caused it)."""
    if tmp is not None:
        tmp.unlink(missing_ok=True)
    failed = write_failed(err, path)
    if failed is None or failed is err:
        raise err
    raise failed from err


def sync(path: Path) -> None:
    """Flush ``path``'s data to its disk (where a delayed allocation reports a full disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: Path, line: str) -> None:
    """Append ``line`` to ``path`` and fsync: the file gains the whole line or, when the write
    fails, is cut back to its old size (never a torn line)."""
    data = memoryview(line.encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            while data:  # one write, unless the disk took only part of it: then the rest fails
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except BaseException as err:
            os.ftruncate(fd, size)
            fail_cleanly(err, path)
    finally:
        os.close(fd)


class UnsafeFile(ValueError):
    """A torch file that holds Python objects other than tensors, arrays and plain data."""


def load_torch(path: Path) -> object:
    """``torch.load`` of a file flrep wrote, with ``weights_only=True``: tensors, numpy arrays and plain
    data load; any other Python object (a crafted pickle that would run code) raises :class:`UnsafeFile`
    naming the file and the object, and nothing of it runs."""
    import numpy as np
    import torch

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    dtypes = [t for t in vars(np.dtypes).values() if isinstance(t, type) and issubclass(t, np.dtype)]
    try:
        with torch.serialization.safe_globals([multiarray._reconstruct, np.ndarray, np.dtype, *dtypes]):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        raise UnsafeFile(f"{path}: refused: it holds a Python object that loading would run "
                         f"({found.group(1) if found else 'not a tensor, array or plain data'}), so it was not "
                         "written by flrep; load only files you made") from None


def save_torch_atomic(obj: object, path: Path) -> None:
    """``torch.save`` to a new file (and its folder) that replaces ``path`` (readers, and hard links
    to the old file, never see a half-written one); on failure the new file is removed."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        import torch  # here: the commands' first-second checks write files without loading torch

        with open(tmp, "wb") as fh:  # a file object: torch's writer then keeps the OSError of a full disk
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException as err:
        fail_cleanly(err, path, tmp)
