"""Shared test fixtures."""

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests import local_grid
from offline_data import SHARED_DATASETS

if SHARED_DATASETS.is_dir():  # the data home of the tests: the offline copies (CI sets it too)
    os.environ.setdefault("FLREP_DATA", str(SHARED_DATASETS.resolve()))

# Nothing the tests do (or the processes they start) writes into the user's home: flrep's caches
# and node state, Flower's ~/.flwr and matplotlib's cache go to a temporary home, removed at the end.
TEST_HOME = tempfile.mkdtemp(prefix="flrep-tests-home-")
os.environ["HOME"] = TEST_HOME


def pytest_unconfigure(config):
    shutil.rmtree(TEST_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def flower_task_identity():
    """Messages built outside a running app need a task identity (as Flower's runtime sets)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    yield


@pytest.fixture(autouse=True)
def simulated_nodes(monkeypatch):
    """The tests' in-process nodes are simulated nodes of ``flrep run``: they share the server's disk."""
    from strategies.state_store import SIMULATION_ENV

    monkeypatch.setenv(SIMULATION_ENV, "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Note when a test starts, before its fixtures run (a module fixture may make runs for it)."""
    item.started_at = time.time()
    local_grid.faults_declared = False
    yield


@pytest.fixture(autouse=True)
def no_failed_client_replies(request, tmp_path_factory):
    """Every run a test makes ends with no failed client reply and no skipped round, unless the
    test declares the faults it injects (marked ``injects_faults``, or a LocalGrid made with
    ``fail``, ``corrupt`` or ``client_errors``): a crashing client fails the test that started its run."""
    checked = request.config.stash.setdefault(CHECKED, set())
    yield
    if request.node.get_closest_marker("injects_faults") or local_grid.faults_declared:
        return
    failures = runs_with_failed_clients(tmp_path_factory.getbasetemp(), getattr(request.node, "started_at", time.time()),
                                        checked)
    assert not failures, "a run of this test had failing clients (mark it injects_faults if it means to):\n" + (
        "\n".join(failures))


CHECKED = pytest.StashKey[set]()


def runs_with_failed_clients(base: Path, started: float, checked: set[Path]) -> list[str]:
    """The summaries under ``base`` written since ``started`` that count failed client replies or
    skipped rounds (``checked``: top folders already read, skipped unless changed since)."""
    failures = []
    for top in base.iterdir():
        if top.is_symlink() or not top.is_dir() or top.stat().st_mtime < started and top in checked:
            continue  # pytest's "current" links, or an older folder this test did not touch
        checked.add(top)
        for path in top.rglob("summary.json"):
            if path.stat().st_mtime < started or "flwr-home" in path.parts:
                continue  # older, or in Flower's unpacked app bundle (the committed reproduction records)
            summary = _summary(path)
            if summary.get("failed_client_replies") or summary.get("rounds_skipped"):
                failures.append(f"{path}: {summary.get('failed_client_replies')} failed client replies, "
                                f"rounds skipped {summary.get('rounds_skipped')}")
    return failures


def _summary(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
