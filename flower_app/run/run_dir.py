"""A run directory is a user's result: it is never overwritten by another run, never deleted,
and every file in it is written atomically (a crash leaves the old file or the new one).

A directory *holds a run* when it (or a variant folder in it) has a run's files. A new run
may only start in a directory that holds none; ``resume=`` continues the run it holds, and
``flrep run --force`` first moves it aside to ``<dir>.old-<timestamp>``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from flower_app.run import run_lock
from task.errors import ConfigError
from task.files import fail_cleanly, sync

#: The files and folders that make a directory a run directory.
RUN_MARKERS = ("summary.json", "metrics.jsonl", "checkpoint", "comparison.md")


def _marks_a_run(path: Path) -> bool:
    """Whether ``path`` shows that a run did something: an empty ``metrics.jsonl`` (and a
    ``config.yaml`` alone) is what a run that stopped before its first round leaves."""
    return path.exists() and (path.name != "metrics.jsonl" or path.stat().st_size > 0)


def run_files(out: Path) -> list[Path]:
    """The run files in ``out`` and in its variant folders (empty when it holds no run, or only
    what a run that did no round left: a new run may start there and writes over it)."""
    if not out.is_dir():
        return []
    folders = [out, *(p for p in sorted(out.iterdir()) if p.is_dir())]
    return [folder / name for folder in folders for name in RUN_MARKERS if _marks_a_run(folder / name)]


def check_writable(out: Path, key: str = "out_dir") -> None:
    """``out`` is a directory this user can create and write: a probe file is made and removed in
    it, or in the nearest folder above it that exists (nothing else is created yet). A probe, not
    ``os.access``: root passes ``os.access`` where no file can be made (``/sys``, some mounts)."""
    existing = out
    while not existing.exists():
        existing = existing.parent
    if existing == out and not out.is_dir():
        raise ConfigError(f"{key}={str(out)!r} is a file; expected a directory for the outputs")
    if not existing.is_dir():
        raise ConfigError(f"{key}={str(out)!r}: {existing} is a file, so the directory cannot be made")
    try:
        _new_file(existing / ".flrep-probe").unlink()
    except OSError as err:
        raise ConfigError(f"{key}={str(out)!r}: {existing} is not writable by this user "
                          f"({err.strerror or err})") from None


def claim(out: Path) -> None:
    """Refuse to start a new run in ``out`` when it holds another run (or cannot be written)."""
    check_writable(out)
    found = run_files(out)
    if found:
        shown = ", ".join(str(p.relative_to(out)) for p in found[:4])
        raise ConfigError(f"out_dir={str(out)!r} holds an earlier run ({shown}); continue it with resume={out}, "
                          "choose another out_dir (--out), or pass --force to move it aside (nothing is deleted)")


def move_aside(out: Path) -> Path | None:
    """Rename the run in ``out`` to ``<out>.old-<timestamp>`` (never deletes); the new path, or None
    when ``out`` holds no run. A command that owns ``out`` (:mod:`flower_app.run.run_lock`) keeps it."""
    if not run_files(out):
        return None
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = out.with_name(f"{out.name}.old-{stamp}")
    n = 1
    while target.exists():
        target = out.with_name(f"{out.name}.old-{stamp}-{n}")
        n += 1
    out.rename(target)
    run_lock.moved(out, target)
    return target


def read_summary(folder: Path) -> dict | None:
    """The run's summary.json, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _new_file(stem: Path, suffix: str = "") -> Path:
    """A new empty file ``<stem>.<random><suffix>`` with the mode ``open(path, "w")`` gives
    (0666 less the umask; ``tempfile.mkstemp`` would give 0600 whatever the umask)."""
    while True:
        path = stem.with_name(f"{stem.name}.{secrets.token_hex(4)}{suffix}")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, fsync it, then rename it onto ``path``
    (which gets the mode of a file written in place: the umask holds). On failure the temporary
    file is removed and a full disk is a :class:`~task.files.WriteFailed` naming ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_file(path.with_name(f".{path.name}"), path.suffix)
    except OSError as err:
        fail_cleanly(err, path)
    try:
        write(tmp)
        sync(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        fail_cleanly(err, path, tmp)


def write_text_atomic(path: Path, text: str) -> None:
    """Atomic ``path.write_text(text)``."""
    write_atomic(path, lambda tmp: tmp.write_text(text))
