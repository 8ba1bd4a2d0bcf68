"""The experiment files of ``conf/experiment/``, found without loading any configuration (so that
``flrep list`` answers at once)."""

from __future__ import annotations

from pathlib import Path

EXPERIMENT_DIR = Path(__file__).resolve().parents[2] / "conf" / "experiment"


def experiment_names() -> list[str]:
    """Names of the experiment files in ``conf/experiment``."""
    return sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml"))
