"""Tests for task.data.partition and task.data.federated_data."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from task.errors import ConfigError
from task.data.federated_data import FederatedData, build_federated_data, clear_caches
from task.data.class_shards import class_shard_test_split
from task.data.partition import (
    PARTITIONS,
    group_test_split,
    matched_test_split,
    partition_train,
)
from task.data.synthetic import make_linear_tasks
from offline_data import shared

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return np.random.default_rng(123).integers(0, 10, size=3000).astype(np.int64)


SCHEMES = {
    "iid": {"partition": "iid"},
    "pathological": {"partition": "pathological", "classes_per_client": 3},
    "dirichlet": {"partition": "dirichlet", "dirichlet_alpha": 0.3, "min_partition_size": 20},
    "shard": {"partition": "shard", "shards_per_client": 2, "shard_size": 70},
    "class_shards": {"partition": "class_shards", "shards_per_client": 2},
}


def check_disjoint(parts, n):
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat), "partitions overlap"
    assert flat.min() >= 0 and flat.max() < n
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)


def test_partition_names():
    assert PARTITIONS == ("iid", "pathological", "dirichlet", "shard", "class_shards", "natural")


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_partition_determinism(labels, scheme):
    cfg = SCHEMES[scheme]
    a = partition_train(labels, None, cfg, 20, seed=7)
    b = partition_train(labels, None, cfg, 20, seed=7)
    c = partition_train(labels, None, cfg, 20, seed=8)
    assert len(a) == 20
    check_disjoint(a, len(labels))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_covers_everything(labels):
    parts = partition_train(labels, None, {"partition": "iid"}, 7, seed=0)
    assert sum(len(p) for p in parts) == len(labels)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    # not contiguous blocks of the original order: the dataset is shuffled first
    assert not np.array_equal(parts[0], np.arange(len(parts[0])))


def test_pathological_classes_per_client(labels):
    parts = partition_train(labels, None, SCHEMES["pathological"], 20, seed=1)
    for p in parts:
        assert len(np.unique(labels[p])) == 3
    used = np.unique(np.concatenate([np.unique(labels[p]) for p in parts]))
    assert used.tolist() == list(range(10))  # first-deterministic mode uses every class
    det = partition_train(labels, None, {"partition": "pathological", "classes_per_client": 2,
                                         "class_assignment_mode": "deterministic"}, 10, seed=1)
    assert [sorted(np.unique(labels[p]).tolist()) for p in det][:3] == [[0, 1], [1, 2], [2, 3]]


def test_dirichlet_min_size(labels):
    parts = partition_train(labels, None, {"partition": "dirichlet", "dirichlet_alpha": 0.5,
                                           "min_partition_size": 50}, 20, seed=3)
    assert min(len(p) for p in parts) >= 50
    assert sum(len(p) for p in parts) == len(labels)
    # strongly non-iid: some client is dominated by few classes
    top = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    assert max(top) > 0.3


def test_dirichlet_impossible_min_size(labels):
    with pytest.raises(ConfigError, match=r"data\.dirichlet_alpha.*data\.min_partition_size"):
        partition_train(labels, None, {"partition": "dirichlet", "dirichlet_alpha": 0.01,
                                       "min_partition_size": 140}, 20, seed=0)
    with pytest.raises(ConfigError, match=r"data\.min_partition_size"):
        partition_train(labels, None, {"partition": "dirichlet", "min_partition_size": 200}, 20, seed=0)


def test_shard_sizes(labels):
    parts = partition_train(labels, None, SCHEMES["shard"], 20, seed=4)
    assert [len(p) for p in parts] == [140] * 20
    order = np.argsort(labels, kind="stable")
    for p in parts:
        # each client holds 2 blocks of 70 consecutive samples of the label-sorted order
        pos = np.flatnonzero(np.isin(order, p))  # positions in the label-sorted order
        blocks = np.unique(pos // 70)
        assert len(blocks) == 2 and len(np.unique(labels[p])) <= 4
    auto = partition_train(labels, None, {"partition": "shard", "shards_per_client": 3}, 20, seed=4)
    assert [len(p) for p in auto] == [3000 // 60 * 3] * 20


def test_natural_partition_toy():
    groups = np.array([5, 5, 9, 2, 9, 9, 2, 7])
    y = np.arange(8) % 3
    parts = partition_train(y, groups, {"partition": "natural"}, 4, seed=0)
    assert [p.tolist() for p in parts] == [[3, 6], [0, 1], [7], [2, 4, 5]]  # sorted group ids 2, 5, 7, 9
    sub = partition_train(y, groups, {"partition": "natural"}, 2, seed=0)
    assert len(sub) == 2 and all(len(np.unique(groups[p])) == 1 for p in sub)
    assert [p.tolist() for p in sub] == [p.tolist() for p in partition_train(y, groups, {"partition": "natural"}, 2, 0)]
    g_test = np.array([9, 2, 2, 5, 1])
    tests = group_test_split(parts, groups, g_test)
    assert [t.tolist() for t in tests] == [[1, 2], [3], [], [0]]
    with pytest.raises(ConfigError, match=r"data\.num_clients=5.*only 4 groups"):
        partition_train(y, groups, {"partition": "natural"}, 5, seed=0)
    with pytest.raises(ConfigError, match=r"data\.partition='natural'.*group"):
        partition_train(y, None, {"partition": "natural", "name": "digits"}, 2, seed=0)


@pytest.mark.parametrize(
    "cfg, n, key",
    [
        ({"partition": "weird"}, 10, "data.partition"),
        ({"partition": "pathological", "classes_per_client": 0}, 10, "data.classes_per_client"),
        ({"partition": "pathological", "classes_per_client": 11}, 10, "data.classes_per_client"),
        ({"partition": "pathological", "class_assignment_mode": "greedy"}, 10, "data.class_assignment_mode"),
        ({"partition": "dirichlet", "dirichlet_alpha": 0}, 10, "data.dirichlet_alpha"),
        ({"partition": "dirichlet", "dirichlet_alpha": "big"}, 10, "data.dirichlet_alpha"),
        ({"partition": "dirichlet", "min_partition_size": -1}, 10, "data.min_partition_size"),
        ({"partition": "shard", "shards_per_client": 0}, 10, "data.shards_per_client"),
        ({"partition": "shard", "shard_size": 200, "shards_per_client": 2}, 10, "data.shard_size"),
        ({"partition": "shard", "shards_per_client": 400}, 10, "data.shards_per_client"),
        ({"partition": "class_shards", "shards_per_client": 3}, 5, "data.shards_per_client"),
        ({"partition": "class_shards", "shard_size": 50}, 10, "data.shard_size"),
        ({"partition": "class_shards", "shards_per_client": 100}, 100, "data.partition"),
        ({"partition": "iid"}, 0, "data.num_clients"),
        ({"partition": "iid"}, 5000, "data.num_clients"),
    ],
)
def test_bad_partition_keys(labels, cfg, n, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        partition_train(labels, None, cfg, n, seed=0)


# ----------------------------------------------------------------------------- class shards (official FedRep)


def shard_blocks(labels: np.ndarray, shards_per_class: int) -> list[np.ndarray]:
    """The official code's shards: each class's indices in order, cut into equal consecutive blocks."""
    return [b for c in np.unique(labels) for b in np.split(np.flatnonzero(labels == c), shards_per_class)]


def test_class_shards_deal_whole_single_class_shards():
    # CIFAR-10 (100, 2) in miniature: 10 equal classes in a shuffled order, 20 clients x 2 shards
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 100))
    test_labels = np.random.default_rng(1).permutation(np.repeat(np.arange(10), 20))
    cfg = SCHEMES["class_shards"]
    parts = partition_train(labels, None, cfg, 20, seed=3)
    tests = class_shard_test_split(labels, test_labels, cfg, 20, seed=3)
    train_blocks, test_blocks = shard_blocks(labels, 4), shard_blocks(test_labels, 4)  # 40 shards: 4 per class
    check_disjoint(parts, len(labels))
    check_disjoint(tests, len(test_labels))
    assert sum(map(len, parts)) == len(labels) and sum(map(len, tests)) == len(test_labels)
    for p, t in zip(parts, tests):
        assert len(p) == 2 * 25 and len(t) == 2 * 5  # shards_per_client x shard size
        own = [b for b in train_blocks if np.isin(b, p).any()]
        assert all(np.isin(b, p).all() for b in own) and len(own) == 2 and sum(map(len, own)) == 50
        # the test shards are of the train shards' classes, with the same multiplicity
        np.testing.assert_array_equal(np.bincount(test_labels[t], minlength=10) // 5,
                                      np.bincount(labels[p], minlength=10) // 25)
        assert all(np.isin(b, t).all() for b in test_blocks if np.isin(b, t).any())
    again = partition_train(labels, None, cfg, 20, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert all(np.array_equal(a, b) for a, b in zip(tests, class_shard_test_split(labels, test_labels, cfg, 20, 3)))


def test_class_shards_give_some_clients_one_class_twice():
    # (100, 2) on 10 classes: a client's second label repeats its first with probability 19/199 = 9.5%
    labels = np.repeat(np.arange(10), 500)
    repeats = [sum(len(np.unique(labels[p])) == 1 for p in partition_train(labels, None, SCHEMES["class_shards"], 100, s))
               for s in range(20)]
    assert 0.06 < np.mean(repeats) / 100 < 0.13 and min(repeats) < max(repeats)


def test_class_shards_spread_the_leftover_over_the_first_shards():
    labels = np.repeat(np.arange(2), [13, 9])  # 2 classes of 4 shards: sizes 4,3,3,3 and 3,2,2,2
    shards = [[0, 1, 2, 12], [3, 4, 5], [6, 7, 8], [9, 10, 11], [13, 14, 21], [15, 16], [17, 18], [19, 20]]
    parts = partition_train(labels, None, {"partition": "class_shards", "shards_per_client": 2}, 4, seed=0)
    check_disjoint(parts, len(labels))
    for p in parts:
        own = [b for b in shards if np.isin(b, p).any()]
        assert len(own) == 2 and sorted(np.concatenate(own).tolist()) == p.tolist()


def test_build_federated_data_class_shards(tmp_path):
    clear_caches()
    fd = build_federated_data(digits_cfg(tmp_path, partition="class_shards", shards_per_client=2,
                                         test_per_client=7), seed=0)
    y, yt = fd.bundle.train.y, fd.bundle.test.y
    assert fd.num_clients == 10 and sum(map(len, fd.client_train)) == len(y)
    assert sum(map(len, fd.client_test)) == len(yt)  # the whole test set, test_per_client ignored
    for p, t in zip(fd.client_train, fd.client_test):
        assert set(np.unique(yt[t])) == set(np.unique(y[p])) and len(np.unique(y[p])) <= 2


# ----------------------------------------------------------------------------- matched test split


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_matched_test_split_distribution(labels, scheme):
    test_labels = np.random.default_rng(9).integers(0, 10, size=2000)
    parts = partition_train(labels, None, SCHEMES[scheme], 20, seed=2)
    tests = matched_test_split(parts, labels, test_labels, 50, seed=2)
    again = matched_test_split(parts, labels, test_labels, 50, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(tests, again))
    check_disjoint(tests, len(test_labels))  # 20 x 50 = 1000 <= 2000: no reuse needed overall
    for p, t in zip(parts, tests):
        assert len(t) == 50
        train_frac = np.bincount(labels[p], minlength=10) / len(p)
        test_cnt = np.bincount(test_labels[t], minlength=10)
        assert set(np.flatnonzero(test_cnt)) <= set(np.flatnonzero(train_frac))
        assert np.all(np.abs(test_cnt - train_frac * 50) < 1.0)


def test_matched_test_split_proportional_and_wraparound():
    train_labels = np.array([0] * 60 + [1] * 40)
    test_labels = np.array([0] * 5 + [1] * 20)
    parts = [np.arange(0, 30), np.arange(30, 60), np.arange(60, 100)]
    tests = matched_test_split(parts, train_labels, test_labels, None, seed=0)
    assert [len(t) for t in tests] == [5, 5, 10]  # n_i = round(25/100 * len(train_i)) = 8, 8, 10
    # class 0 has only 5 test samples: client 0 wants 8 but gets the 5 distinct ones,
    # client 1 finds the queue exhausted and wraps around to the same 5
    assert tests[0].tolist() == [0, 1, 2, 3, 4] and tests[1].tolist() == [0, 1, 2, 3, 4]
    assert len(tests[2]) == 10 and np.all(test_labels[tests[2]] == 1)
    # the wrap-around continues the queue order instead of restarting it
    small = matched_test_split([np.arange(0, 30)] * 3, train_labels, np.array([0] * 5), 2, seed=0)
    assert len(np.unique(np.concatenate(small[:2]))) == 4
    assert np.intersect1d(small[2], np.concatenate(small[:2])).size == 1
    with pytest.raises(ConfigError, match=r"data\.test_per_client"):
        matched_test_split(parts, train_labels, test_labels, 0, seed=0)


# ----------------------------------------------------------------------------- federated data


def digits_cfg(tmp_path, **kw):
    return {"name": "digits", "cache_dir": str(tmp_path), "num_clients": 10, "partition": "pathological",
            "classes_per_client": 2, **kw}


def test_build_federated_data_digits(tmp_path):
    clear_caches()
    cfg = digits_cfg(tmp_path, num_new_clients=2, test_per_client=20)
    t = time.perf_counter()
    fd = build_federated_data(cfg, seed=0)
    first = time.perf_counter() - t
    assert isinstance(fd, FederatedData) and fd.num_clients == 10
    assert fd.new_clients == [8, 9]
    assert np.array_equal(fd.global_test, np.arange(len(fd.bundle.test.y)))
    assert all(len(t) == 20 for t in fd.client_test)
    for p, t in zip(fd.client_train, fd.client_test):
        assert set(np.unique(fd.bundle.test.y[t])) <= set(np.unique(fd.bundle.train.y[p]))
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 1
    t = time.perf_counter()
    assert build_federated_data(dict(cfg), seed=0) is fd  # in-process cache
    assert time.perf_counter() - t < 0.05
    clear_caches()
    t = time.perf_counter()
    fd2 = build_federated_data(cfg, seed=0)  # from the disk cache
    assert time.perf_counter() - t < first
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_train, fd2.client_train))
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_test, fd2.client_test))
    fd3 = build_federated_data(cfg, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(fd.client_train, fd3.client_train))
    # a fresh computation (no disk cache) gives the same partition: pure function of (cfg, seed)
    clear_caches()
    fd4 = build_federated_data({**cfg, "cache_dir": str(tmp_path / "other")}, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_train, fd4.client_train))


def test_build_federated_data_iid_proportional(tmp_path):
    fd = build_federated_data({"name": "digits", "cache_dir": str(tmp_path), "num_clients": 9}, seed=0)
    assert sum(len(p) for p in fd.client_train) == len(fd.bundle.train.y)
    assert all(abs(len(t) - 50) <= 1 for t in fd.client_test)  # 450/1347 * ~150


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"num_clients": 0}, "data.num_clients"),
        ({"num_new_clients": 10}, "data.num_new_clients"),
        ({"num_new_clients": -1}, "data.num_new_clients"),
        ({"test_per_client": 0}, "data.test_per_client"),
        ({"partition": "natural"}, "data.partition"),
    ],
)
def test_build_federated_data_bad_keys(tmp_path, extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_federated_data(digits_cfg(tmp_path, **extra), seed=0)


def test_build_federated_data_synthetic(tmp_path):
    cfg = {"name": "synthetic_linear", "num_clients": 6, "cache_dir": str(tmp_path),
           "synthetic": {"d": 8, "k": 2, "n_train": 5, "n_test": 7, "seed": 3}}
    fd = build_federated_data(cfg, seed=11)
    _, tr, te, b_star = make_linear_tasks(6, 8, 2, 5, 7, 0.01, 3)
    assert fd.bundle.task == "regression"
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_train, tr))
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_test, te))
    np.testing.assert_allclose(fd.bundle.meta["B_star"], b_star, rtol=1e-6)
    with pytest.raises(ConfigError, match=r"data\.partition='iid'.*regression"):
        build_federated_data({**cfg, "partition": "iid"}, seed=11)


def test_no_flower_import():
    code = (
        "import sys, numpy as np\n"
        "from task.data.partition import partition_train\n"
        "import task.data.federated_data, task.data.sources, task.data.synthetic\n"
        "partition_train(np.arange(100) % 10, None, {'partition': 'shard'}, 5, 0)\n"
        "bad = [m for m in sys.modules if m == 'flwr' or m.startswith('flwr.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ----------------------------------------------------------------------------- real data


def test_mnist_mcmahan_shards(tmp_path):
    root = shared("mnist")
    cfg = {"name": "mnist", "root": str(root), "cache_dir": str(tmp_path), "num_clients": 100,
           "partition": "shard", "shards_per_client": 2, "shard_size": 300, "test_per_client": 100}
    clear_caches()
    fd = build_federated_data(cfg, seed=0)
    y, yt = fd.bundle.train.y, fd.bundle.test.y
    order = np.argsort(y, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    assert len(np.unique(np.concatenate(fd.client_train))) == 60000
    for p, t in zip(fd.client_train, fd.client_test):
        assert len(p) == 600
        assert len(np.unique(rank[p] // 300)) == 2  # exactly two shards of the label-sorted order
        assert len(t) == 100
        train_frac = np.bincount(y[p], minlength=10) / 600
        test_cnt = np.bincount(yt[t], minlength=10)
        assert set(np.flatnonzero(test_cnt)) <= set(np.flatnonzero(train_frac))
        assert np.all(np.abs(test_cnt - 100 * train_frac) < 1.0)
    all_test = np.concatenate(fd.client_test)
    assert len(all_test) == 10000  # 100 x 100 = len(test): mostly without reuse
    clear_caches()
    t = time.perf_counter()
    fd2 = build_federated_data(cfg, seed=0)
    assert time.perf_counter() - t < 5
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_train, fd2.client_train))


def test_femnist_natural(tmp_path):
    root = shared("femnist")
    cfg = {"name": "femnist", "root": str(root), "cache_dir": str(tmp_path), "num_clients": 110}
    fd = build_federated_data(cfg, seed=0)
    g, gt = fd.bundle.train.group, fd.bundle.test.group
    assert sum(len(p) for p in fd.client_train) == 14697 and sum(len(t) for t in fd.client_test) == 1695
    for i, (p, t) in enumerate(zip(fd.client_train, fd.client_test)):
        assert np.all(g[p] == i) and np.all(gt[t] == i) and len(t) > 0
    sub = build_federated_data({**cfg, "num_clients": 50, "num_new_clients": 5}, seed=0)
    assert sub.num_clients == 50 and sub.new_clients == list(range(45, 50))
    for p, t in zip(sub.client_train, sub.client_test):
        assert np.unique(g[p]).size == 1 and np.array_equal(np.unique(gt[t]), np.unique(g[p]))


def test_build_federated_data_accepts_omegaconf(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create(
        {"seed": 4, "data": {"name": "digits", "num_clients": 4, "split_seed": "${seed}", "cache_dir": str(tmp_path)}}
    )
    fd = build_federated_data(cfg.data, seed=0)
    plain = build_federated_data({"name": "digits", "num_clients": 4, "split_seed": 4, "cache_dir": str(tmp_path)}, 0)
    assert fd is plain  # same canonical key -> same in-process cache entry
    assert fd.num_clients == 4
