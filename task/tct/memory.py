"""What TCT's eNTK features cost in disk and memory, stated and checked before any is computed:
the bytes of stored feature rows, the free disk they need, and the stage-2 Gram matrix of the
largest client (min(n_k, p)² per client) against this machine's memory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from task.errors import ConfigError
from task.tct.linear import FEATURE_DTYPES

GIB = float(1 << 30)


def feature_bytes(rows: int, p: int, dtype: str) -> int:
    """Bytes of ``rows`` stored feature rows of ``p`` coordinates in ``dtype`` (``tct.feature_dtype``)."""
    return rows * p * FEATURE_DTYPES[dtype].itemsize


def require_disk(folder: Path, needed: int, what: str) -> None:
    """Refuse to start writing ``needed`` bytes where the disk cannot hold them."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise RuntimeError(f"tct.features: {what} need {needed / GIB:.2f} GiB in {folder}, only {free / GIB:.2f} GiB "
                           "free; lower tct.features, use tct.feature_dtype=float16 or point client_state.dir elsewhere")


def physical_memory() -> int:
    """Bytes of physical memory of this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def memory_plan(p: int, dtype: str, train_sizes: list[int], test_rows: int) -> str:
    """The feature memory of a run, stated before any feature is computed."""
    largest = max(train_sizes) if train_sizes else 0
    side = min(largest, p)
    return (f"TCT features: p={p:,} {dtype}: {sum(train_sizes):,} client samples = "
            f"{feature_bytes(sum(train_sizes), p, dtype) / GIB:.2f} GiB on the nodes' disks (largest client "
            f"{feature_bytes(largest, p, dtype) / GIB:.2f} GiB), {test_rows:,} test samples = "
            f"{feature_bytes(test_rows, p, dtype) / GIB:.2f} GiB on the server's; stage 2 holds one client's "
            f"{side:,}x{side:,} Gram eigenvectors ({side * side * 8 / GIB:.2f} GiB) and streams features in "
            f"256 MiB blocks")


def check_gram_memory(train_sizes: list[int], p: int) -> None:
    """Refuse a run whose stage-2 Gram matrix (min(largest client's samples, p)²) cannot fit in this
    machine's memory (ConfigError naming ``tct.features``)."""
    side = min(max(train_sizes, default=0), p)
    needed, available = 3 * side * side * 8, physical_memory()
    if available and needed > available:
        raise ConfigError(f"tct.features: stage 2 needs about {needed / GIB:.1f} GiB for a {side:,}x{side:,} Gram "
                          f"matrix (min(largest client's samples, p)), this machine has {available / GIB:.1f} GiB; "
                          "lower tct.features")
