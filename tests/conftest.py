"""Shared test fixtures."""

import os

import pytest

from offline_data import SHARED_DATASETS

if SHARED_DATASETS.is_dir():  # the data home of the tests: the offline copies (CI sets it too)
    os.environ.setdefault("FLREP_DATA", str(SHARED_DATASETS.resolve()))


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
