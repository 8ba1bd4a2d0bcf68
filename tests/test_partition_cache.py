"""A deployed node's ClientApp processes read only their own partition from the node's cache."""

import numpy as np
import pytest

from task.data import partition_cache
from task.data.datasets.images import ImageArray
from task.data.federated_data import build_federated_data
from task.errors import ConfigError
from tests.offline_data import shared

SEED = 3


def test_a_cached_partition_holds_exactly_the_clients_samples_and_is_read_without_the_dataset(tmp_path, monkeypatch):
    cfg = {"name": "fashion_mnist", "root": str(shared("fashion-mnist")), "num_clients": 10, "partition": "pathological",
           "classes_per_client": 2, "test_per_client": 30, "cache_dir": str(tmp_path / "data-cache")}
    fed = build_federated_data(cfg, SEED)
    first = partition_cache.client_data(cfg, SEED, 4, tmp_path / "node")
    assert partition_cache.cache_file(cfg, SEED, 4, tmp_path / "node").is_file()
    assert isinstance(first.bundle.train.x, ImageArray) and first.bundle.train.x.raw.dtype == np.uint8
    monkeypatch.setattr(partition_cache, "build_federated_data", lambda *a: pytest.fail("the dataset was loaded again"))
    again = partition_cache.client_data(cfg, SEED, 4, tmp_path / "node")
    for split, idx in (("train", fed.client_train[4]), ("test", fed.client_test[4])):
        ours, full = getattr(again.bundle, split), getattr(fed.bundle, split)
        assert np.array_equal(np.asarray(ours.x), full.x[idx]) and np.array_equal(ours.y, full.y[idx])
    assert again.num_clients == 1 and again.bundle.input_shape == fed.bundle.input_shape
    assert again.bundle.num_classes == fed.bundle.num_classes
    assert partition_cache.cache_file({**cfg, "classes_per_client": 3}, SEED, 4, tmp_path) != \
        partition_cache.cache_file(cfg, SEED, 4, tmp_path)
    assert partition_cache.cache_file(cfg, SEED + 1, 4, tmp_path) != partition_cache.cache_file(cfg, SEED, 4, tmp_path)


def test_a_partition_id_outside_the_federation_is_named(tmp_path):
    cfg = {"name": "digits", "num_clients": 4, "cache_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="partition-id 4 is outside the 4 clients"):
        partition_cache.client_data(cfg, 0, 4, tmp_path / "node")


def test_a_process_serving_twenty_nodes_builds_the_model_once_and_reads_each_partition_once(tmp_path, monkeypatch):
    """As in ``flwr run``'s simulation, where one worker serves many nodes by partition id: 20 nodes through one
    process for 3 rounds read each partition once and build the variant's model once, not at every message."""
    from flower_app.app import client_app
    from flower_app.app.server_app import Experiment
    from flower_app.run.config import load_config
    from strategies.state_store import SIMULATION_ENV
    from tests.local_grid import LocalGrid

    monkeypatch.delenv(SIMULATION_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    models, partitions = [], []
    build_model, read_partition = client_app.initial_model, client_app.client_data
    monkeypatch.setattr(client_app, "initial_model", lambda *a: models.append(1) or build_model(*a))
    monkeypatch.setattr(client_app, "client_data", lambda *a: partitions.append(a[2]) or read_partition(*a))
    overrides = (f"wandb.enabled=false compare=[] data.num_clients=20 train.fraction=1.0 rounds=3 eval.every=1 "
                 f"out_dir={tmp_path / 'out'}")
    grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
    Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert len(grid.sent) > 60  # every node was sent a message in every round
    assert len(models) == 1 and sorted(partitions) == list(range(20))
