"""What code a run executed: the project's modules its process imported and one hash of their source.

``summary.json`` records it (``source``), so a table can tell whether a run's code still is the
code of the tree now (``flrep reproduce --index`` flags a primary whose code changed since).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

PACKAGES = ("flower_app", "strategies", "protocols", "task", "conf")  # the app's own code and configs


def source_hash(modules: Iterable[str], text: Callable[[str], str | None]) -> str:
    """One sha256 (16 hex digits) over the path and text of each module (``text(path)``: its source,
    None when it no longer exists)."""
    digest = hashlib.sha256()
    for path in sorted(modules):
        digest.update(path.encode() + b"\0" + (text(path) or "\0missing").encode() + b"\0")
    return digest.hexdigest()[:16]


def executed_sources(root: Path) -> dict:
    """``{"modules": [...], "hash": ...}`` of the project's modules imported by this process (paths
    relative to ``root``, the app's folder)."""
    root = root.resolve()
    modules = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        if path.suffix == ".py" and path.is_relative_to(root) and path.relative_to(root).parts[0] in PACKAGES:
            modules.add(path.relative_to(root).as_posix())

    def text(rel: str) -> str | None:
        file = root / rel
        return file.read_text() if file.is_file() else None

    return {"modules": sorted(modules), "hash": source_hash(modules, text)}
