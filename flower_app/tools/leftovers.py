"""What runs left outside their run folders: the client state and snapshots that deployed nodes
(and ``flwr run .``'s simulated ones) keep under ``~/.cache/flrep/node-state`` or a node's
``state-dir``, and what older versions kept under ``<data.cache_dir>/client-state``.

Each folder of kept state names the run folder it belongs to (``owner.json``, written by
:func:`strategies.state_store.mark_owner`). A folder is left behind when that run folder holds a
completed run (nothing is left to resume) or no longer exists; one modified in the last
:data:`IN_USE_S` seconds is in use and never removed; one that names no run folder is removed
only once idle for :data:`UNKNOWN_IDLE_S`.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from strategies.state_store import NODE_CACHE, NODE_DEFAULT, OWNER_FILE, RUN_STATE

#: A folder changed this recently belongs to a run that is going on.
IN_USE_S = 600.0
#: A folder that names no run folder (an older version's) counts as left behind after this long idle.
UNKNOWN_IDLE_S = 7 * 24 * 3600.0


@dataclass
class Leftover:
    """One folder of kept state: where, of which run folder, how big, and whether it may go."""

    path: Path
    run_folder: str | None
    bytes: int
    idle_s: float
    verdict: str  # finished | deleted | resumable | in use | unknown

    @property
    def removable(self) -> bool:
        return self.verdict in ("finished", "deleted") or (self.verdict == "unknown" and self.idle_s > UNKNOWN_IDLE_S)


def default_roots() -> list[Path]:
    """Where runs keep state outside their folders on this machine."""
    return [NODE_DEFAULT.expanduser(), NODE_CACHE.expanduser() / RUN_STATE]


def state_folders(root: Path) -> list[Path]:
    """The folders of kept state under ``root``: ``run<id>-client<pid>`` and ``checkpoints/<run>``."""
    if not root.is_dir():
        return []
    found = [p for p in sorted(root.glob("run*-client*")) if p.is_dir()]
    return found + [p for p in sorted((root / "checkpoints").glob("*")) if p.is_dir()]


def _verdict(run_folder: str | None, idle_s: float) -> str:
    if idle_s < IN_USE_S:
        return "in use"
    if run_folder is None:
        return "unknown"
    folder = Path(run_folder)
    if not folder.exists():
        return "deleted"
    try:
        status = json.loads((folder / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        status = None
    return "finished" if status == "completed" else "resumable"


def survey(roots: list[Path], now: float | None = None) -> list[Leftover]:
    """Every folder of kept state under ``roots``, judged."""
    now = time.time() if now is None else now
    out = []
    for root in roots:
        for folder in state_folders(root):
            files = [p for p in folder.rglob("*") if p.is_file()]
            newest = max([folder.stat().st_mtime, *(p.stat().st_mtime for p in files)])
            try:
                run_folder = json.loads((folder / OWNER_FILE).read_text()).get("run_folder")
            except (OSError, ValueError):
                run_folder = None
            out.append(Leftover(folder, run_folder, sum(p.stat().st_size for p in files), now - newest,
                                _verdict(run_folder, now - newest)))
    return out


def remove(leftovers: list[Leftover]) -> list[Leftover]:
    """Remove the removable ones; those removed."""
    gone = [item for item in leftovers if item.removable]
    for item in gone:
        shutil.rmtree(item.path, ignore_errors=True)
    return gone
