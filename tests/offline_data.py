"""The offline dataset copies in ../shared/datasets, for tests that need real files."""

from pathlib import Path

import pytest

SHARED_DATASETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets"


def shared(sub: str) -> Path:
    """Path of ``../shared/datasets/<sub>``; skips the calling test when it is absent."""
    path = SHARED_DATASETS / sub
    if not path.exists():
        pytest.skip(f"offline dataset copy {path} is absent")
    return path
