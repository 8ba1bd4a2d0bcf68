"""The offline dataset copies in ../shared/datasets, for tests that need real files."""

import os
from pathlib import Path

import pytest

SHARED_DATASETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets"


def shared(sub: str) -> Path:
    """Path of ``../shared/datasets/<sub>``; skips the calling test when it is absent, or fails it
    where the data must be there (``FLREP_TESTS_NEED_DATA=1``, as in CI)."""
    path = SHARED_DATASETS / sub
    if not path.exists():
        if os.environ.get("FLREP_TESTS_NEED_DATA") == "1":
            pytest.fail(f"offline dataset copy {path} is absent (FLREP_TESTS_NEED_DATA=1: the tests need it)")
        pytest.skip(f"offline dataset copy {path} is absent")
    return path
