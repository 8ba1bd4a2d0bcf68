"""One owner per folder: an exclusive OS lock (``fcntl.flock``) on ``<folder>/.flrep.lock``, taken
before a command's first write there and held for the command's life. The kernel drops it when
the process ends, however it ends, so a killed command never leaves a folder locked; the file
holds the owner's PID, which a refused command names. The file is no result: it is removed when
the lock is given up (a killed owner leaves it, and the next owner takes it over).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from task.errors import ConfigError

LOCK_FILE = ".flrep.lock"
#: Free bytes a folder's file system must have before a command takes the folder: room for the
#: lock and the first small files (a run that fills the disk later stops as docs/reliability.md says).
MIN_FREE_BYTES = 64 * 1024
FULL = (errno.ENOSPC, errno.EDQUOT)


class FolderBusy(ConfigError):
    """Another process owns the folder."""


class NoRoom(ConfigError):
    """The folder's file system is full: nothing was made there."""


def _no_room(folder: Path, free: int | None = None) -> NoRoom:
    said = "" if free is None else f" ({free:,} bytes free; a command needs {MIN_FREE_BYTES // 1024} KiB to start)"
    return NoRoom(f"no space left on the disk of {folder}{said}: free some space or choose another folder")


def _check_room(folder: Path) -> None:
    """NoRoom, before anything is made, when ``folder``'s file system has no room to start in."""
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    st = os.statvfs(existing)
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise _no_room(folder, free)


@dataclass
class _Held:
    fd: int
    made: Path | None  # the topmost folder that taking the lock created (removed again if left empty)


_HELD: dict[Path, _Held] = {}


def acquire(folder: Path) -> bool:
    """Own ``folder`` (made if missing) from now until :func:`release` or the process's end; False
    when this process owns it already. FolderBusy names the folder and the owner's PID."""
    folder = folder.resolve()
    held = _HELD.get(folder)
    if held is not None and _same_file(held.fd, folder / LOCK_FILE):
        return False
    if held is not None:  # the folder was moved away beneath this lock
        os.close(_HELD.pop(folder).fd)
    _check_room(folder)
    made = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
    path = folder / LOCK_FILE
    fd = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FolderBusy(f"{folder} is in use by another flrep command (PID {_owner(path)}); wait for "
                                 "it to end, or choose another folder") from None
            if _same_file(fd, path):
                break
            os.close(fd)  # its last owner removed it between our open and lock: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as error:
        if error.errno not in FULL:
            raise
        if fd is not None:  # the disk filled between the check and the lock: leave nothing behind
            path.unlink(missing_ok=True)
            os.close(fd)
        _remove_empty(folder, made)
        raise _no_room(folder) from None
    _HELD[folder] = _Held(fd, made)
    return True


def release(folder: Path) -> None:
    """Give ``folder`` up: its lock file is removed, then the folders the lock made if still empty."""
    folder = folder.resolve()
    held = _HELD.pop(folder, None)
    if held is None:
        return
    if _same_file(held.fd, folder / LOCK_FILE):
        (folder / LOCK_FILE).unlink()
    os.close(held.fd)
    _remove_empty(folder, held.made)


def _remove_empty(folder: Path, made: Path | None) -> None:
    """Remove ``folder`` and its parents up to ``made`` (the topmost one a lock made) while empty."""
    if made is None:
        return
    for path in [folder, *folder.parents]:
        try:
            path.rmdir()
        except OSError:
            break
        if path == made:
            break


def moved(folder: Path, to: Path) -> None:
    """``folder`` was renamed to ``to``: when this process owned it, it owns a new ``folder`` now,
    and the moved run keeps no lock file."""
    held = _HELD.pop(folder.resolve(), None)
    if held is None:
        return
    try:
        acquire(folder)
    finally:
        (to / LOCK_FILE).unlink(missing_ok=True)
        os.close(held.fd)


@contextmanager
def owned() -> Iterator[None]:
    """Every folder locked inside the block is given up at its end."""
    before = set(_HELD)
    try:
        yield
    finally:
        for folder in [f for f in _HELD if f not in before]:
            release(folder)


@contextmanager
def hold(folder: Path) -> Iterator[None]:
    """Own ``folder`` for the block (an owner outside the block keeps it)."""
    with owned():
        acquire(folder)
        yield


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _owner(path: Path) -> str:
    """The PID in a held lock file, once it names a live process: its owner may be writing it just
    now, over nothing or over the PID of a killed owner that left the file."""
    for _ in range(40):
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() and _alive(int(text)):
            return text
        time.sleep(0.05)
    return "unknown"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
