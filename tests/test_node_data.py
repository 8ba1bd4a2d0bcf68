"""Per-node data (task.data.node_data): native-format writers, loading from data-path, checks."""

import gzip
import json
import struct

import numpy as np
import pytest

from task.data.datasets.bundle import ArrayData, DataBundle
from task.data.datasets.images import images_to_float
from task.errors import ConfigError
from task.data.federated_data import build_federated_data
from task.data.node_data import check_node_data, load_node_data, write_node_data, write_partitions
from task.data.sources import load_source


def _cfg(name, tmp_path, **extra):
    return {"name": name, "normalize": False, "cache_dir": str(tmp_path / "cache"), **extra}


def _images(rng, n, shape, num_classes):
    """A split of random uint8 images as floats in [0, 1]; labels cycle through all classes."""
    return ArrayData(images_to_float(rng.integers(0, 256, (n, *shape), dtype=np.uint8)),
                     np.arange(n, dtype=np.int64) % num_classes)


def _write_idx_gz(path, arr):
    header = struct.pack(">" + "I" * (arr.ndim + 1), 0x800 + arr.ndim, *arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


def _global_mnist(root, rng):
    """A tiny mnist copy (80 train / 40 test) as the four IDX files; returns the uint8 arrays."""
    root.mkdir()
    arrays = {}
    for prefix, n in (("train", 80), ("t10k", 40)):
        arrays[prefix] = (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), np.arange(n) % 10)
        _write_idx_gz(root / f"{prefix}-images-idx3-ubyte.gz", arrays[prefix][0])
        _write_idx_gz(root / f"{prefix}-labels-idx1-ubyte.gz", arrays[prefix][1])
    return arrays


def _global_femnist(root, rng):
    """Tiny LEAF json shards: 3 writers with letters a-j (LEAF 36-45) and digits in both splits."""
    for split, n in (("train", 6), ("test", 3)):
        (root / split).mkdir(parents=True)
        users = ["f_0", "f_1", "f_2"]
        data = {u: {"x": rng.random((n, 784)).round(6).tolist(), "y": [36 + (i % 10) if i % 3 else i for i in range(n)]}
                for u in users}
        shard = {"users": users, "num_samples": [n] * 3, "user_data": data}
        (root / split / f"all_{split}.json").write_text(json.dumps(shard))


@pytest.mark.parametrize("name, shape, num_classes, extra", [
    ("mnist", (28, 28), 10, {}),
    ("fashion_mnist", (28, 28), 10, {}),
    ("cifar10", (32, 32, 3), 10, {}),
    ("cifar100", (32, 32, 3), 100, {}),
    ("image_folder", (8, 8, 3), 3, {}),
    ("image_folder", (8, 8), 12, {"image_channels": 1}),
])
def test_image_formats_round_trip_exactly(tmp_path, name, shape, num_classes, extra):
    rng = np.random.default_rng(0)
    train, test = _images(rng, 24, shape, num_classes), _images(rng, 13, shape, num_classes)
    node = write_node_data(name, tmp_path / "node", train, test)
    bundle = load_node_data(_cfg(name, tmp_path, **extra), node)
    for orig, got in ((train, bundle.train), (test, bundle.test)):
        # the image-folder reader lists samples by class folder, then file name (= position)
        order = np.argsort(orig.y, kind="stable") if name == "image_folder" else np.arange(len(orig))
        np.testing.assert_array_equal(got.y, orig.y[order])
        np.testing.assert_array_equal(got.x, orig.x[order])


def test_femnist_round_trip_keeps_writer_and_leaf_labels(tmp_path):
    _global_femnist(tmp_path / "global", np.random.default_rng(1))
    cfg = _cfg("femnist", tmp_path, femnist_classes="letters")
    full = load_source({**cfg, "root": str(tmp_path / "global")})
    mine = {s: np.flatnonzero(getattr(full, s).group == 1) for s in ("train", "test")}
    node = write_node_data("femnist", tmp_path / "node", *(ArrayData(
        getattr(full, s).x[i], getattr(full, s).y[i], getattr(full, s).group[i]) for s, i in mine.items()), full.meta)
    bundle = load_node_data(cfg, node)
    assert bundle.meta["writers"] == ["f_1"] and bundle.num_classes == 10
    for s, idx in mine.items():
        np.testing.assert_array_equal(getattr(bundle, s).y, getattr(full, s).y[idx])
        np.testing.assert_array_equal(getattr(bundle, s).x, getattr(full, s).x[idx])


_ADULT_ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K",
    "50, Self-emp, 83311, Bachelors, 13, Married, Exec, Husband, White, Male, 0, 0, 13, United-States, >50K",
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers, Not-in-family, Black, Female, 0, 0, 40, ?, <=50K",
    "53, Private, 234721, 11th, 7, Married, Handlers, Husband, Black, Male, 0, 0, 40, Cuba, >50K",
]


def test_adult_rows_are_rewritten_field_for_field(tmp_path):
    root = tmp_path / "global"
    root.mkdir()
    (root / "adult.data").write_text("\n".join(_ADULT_ROWS) + "\n")
    (root / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(r + "." for r in _ADULT_ROWS[1:3]) + "\n")
    cfg = _cfg("adult", tmp_path, adult_include_protected=False)
    full = load_source({**cfg, "root": str(root)})
    node = write_node_data("adult", tmp_path / "node", full.train, full.test, full.meta)
    bundle = load_node_data(cfg, node)
    for orig, got in ((full.train, bundle.train), (full.test, bundle.test)):
        np.testing.assert_array_equal(got.x, orig.x)
        np.testing.assert_array_equal(got.y, orig.y)
        assert {k: v.tolist() for k, v in got.attributes.items()} == {k: v.tolist() for k, v in orig.attributes.items()}
    assert (node / "adult.data").read_text().splitlines() == _ADULT_ROWS


def test_write_partitions_gives_each_node_its_partition(tmp_path):
    rng = np.random.default_rng(2)
    arrays = _global_mnist(tmp_path / "global", rng)
    cfg = {"name": "mnist", "root": str(tmp_path / "global"), "cache_dir": str(tmp_path / "cache"),
           "num_clients": 4, "partition": "pathological", "classes_per_client": 2}
    dirs = write_partitions(cfg, 3, tmp_path / "nodes")
    fed = build_federated_data(cfg, 3)
    raw = build_federated_data({**cfg, "normalize": False}, 3)
    assert dirs == [tmp_path / "nodes" / f"node-{i}" for i in range(4)]
    for i, node_dir in enumerate(dirs):
        bundle = load_node_data({**cfg, "normalize": False}, node_dir)
        check_node_data(bundle, (1, 28, 28), 10, node_dir)
        for split, idx, raw_idx, prefix in (("train", fed.client_train[i], raw.client_train[i], "train"),
                                            ("test", fed.client_test[i], raw.client_test[i], "t10k")):
            np.testing.assert_array_equal(idx, raw_idx)  # normalize does not change the partition
            np.testing.assert_array_equal(getattr(bundle, split).y, getattr(fed.bundle, split).y[idx])
            np.testing.assert_array_equal(getattr(bundle, split).x, images_to_float(arrays[prefix][0][idx]))


def test_write_partitions_femnist_natural_keeps_writers(tmp_path):
    _global_femnist(tmp_path / "global", np.random.default_rng(3))
    cfg = _cfg("femnist", tmp_path, root=str(tmp_path / "global"), num_clients=3, partition="natural")
    fed = build_federated_data(cfg, 0)
    for i, node_dir in enumerate(write_partitions(cfg, 0, tmp_path / "nodes")):
        bundle = load_node_data(cfg, node_dir)
        assert bundle.meta["writers"] == [fed.bundle.meta["writers"][fed.bundle.train.group[fed.client_train[i][0]]]]
        np.testing.assert_array_equal(bundle.train.y, fed.bundle.train.y[fed.client_train[i]])
        np.testing.assert_array_equal(bundle.test.y, fed.bundle.test.y[fed.client_test[i]])


def test_load_errors_name_data_path(tmp_path):
    with pytest.raises(ConfigError, match=r"node config data-path='.*missing' does not exist"):
        load_node_data(_cfg("mnist", tmp_path), tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"node config data-path='.*': data.root=.*no complete set of mnist IDX"):
        load_node_data(_cfg("mnist", tmp_path), tmp_path)
    for name in ("digits", "synthetic_linear"):
        with pytest.raises(ConfigError, match=r"data-path=.*needs a file-based data.name \(mnist, .*adult\)"):
            load_node_data(_cfg(name, tmp_path), tmp_path)


def test_check_errors_name_data_path():
    rng = np.random.default_rng(4)
    split = _images(rng, 4, (28, 28), 10)
    bundle = DataBundle(split, split, 10, (1, 28, 28))
    check_node_data(bundle, (1, 28, 28), 10, "/node")
    with pytest.raises(ConfigError, match=r"data-path='/node': inputs have shape \(1, 28, 28\); expected \(3, 32, 32\)"):
        check_node_data(bundle, (3, 32, 32), 10, "/node")
    with pytest.raises(ConfigError, match=r"data-path='/node': the data has 10 classes; expected 2"):
        check_node_data(bundle, (1, 28, 28), 2, "/node")
    bad = DataBundle(split, ArrayData(split.x, split.y + 7), 10, (1, 28, 28))
    with pytest.raises(ConfigError, match=r"data-path='/node': test labels \[10\] are outside \[0, 10\)"):
        check_node_data(bad, (1, 28, 28), 10, "/node")
    empty = DataBundle(ArrayData(split.x[:0], split.y[:0]), split, 10, (1, 28, 28))
    with pytest.raises(ConfigError, match=r"data-path='/node': the train split is empty"):
        check_node_data(empty, (1, 28, 28), 10, "/node")


def test_writers_refuse_data_they_cannot_write_back(tmp_path):
    rng = np.random.default_rng(5)
    split = _images(rng, 4, (28, 28), 10)
    with pytest.raises(ConfigError, match="expected un-normalised images in"):
        write_node_data("mnist", tmp_path / "a", ArrayData(split.x - 0.5, split.y), split)
    with pytest.raises(ConfigError, match="writers \\['w1'\\] have samples in only one of train/test"):
        write_node_data("femnist", tmp_path / "b", ArrayData(split.x, split.y, np.array([0, 0, 1, 1])),
                        ArrayData(split.x, split.y, np.zeros(4, np.int64)), {"writers": ["w0", "w1"]})
    write_node_data("mnist", tmp_path / "c", split, split)
    with pytest.raises(ConfigError, match="directory is not empty"):
        write_node_data("mnist", tmp_path / "c", split, split)


def _mnist_federation(tmp_path, out: str, data_paths=None, algorithm: str = "fedrep", extra: str = "",
                      client_errors: bool = False) -> dict:
    """``algorithm`` on the tiny mnist copy, 3 clients; each node reads ``data_paths[pid]`` when given
    (``client_errors``: a node is given data it must refuse)."""
    from flower_app.run.config import load_config
    from flower_app.app.server_app import Experiment
    from tests.local_grid import LocalGrid

    overrides = (f"algorithm={algorithm} wandb.enabled=false compare=[] data.name=mnist data.root={tmp_path / 'global'} "
                 f"data.cache_dir={tmp_path / 'cache'} data.normalize=false data.num_clients=3 "
                 f"data.classes_per_client=2 model.name=mlp_mnist rounds=2 train.fraction=1.0 eval.every=1 "
                 f"eval.final_window=1 fedrep.head_epochs=2 out_dir={tmp_path / out} {extra}").strip()
    grid = LocalGrid(3, {"experiment": "quickstart", "overrides": overrides}, client_errors=client_errors)
    for pid, path in (data_paths or {}).items():
        grid.contexts[grid.node_ids[pid]].node_config["data-path"] = str(path)
    return Experiment(grid, load_config("quickstart", overrides.split())).run()


@pytest.mark.parametrize("algorithm", ["fedrep", "fedavg"])
def test_nodes_with_their_own_data_train_as_on_the_partitions_they_hold(tmp_path, algorithm):
    _global_mnist(tmp_path / "global", np.random.default_rng(6))
    cfg = {"name": "mnist", "root": str(tmp_path / "global"), "cache_dir": str(tmp_path / "cache"), "normalize": False,
           "num_clients": 3, "partition": "pathological", "classes_per_client": 2}
    dirs = write_partitions(cfg, 0, tmp_path / "nodes")
    partitioned = _mnist_federation(tmp_path, "partitioned", algorithm=algorithm)
    own = _mnist_federation(tmp_path, "own", dict(enumerate(dirs)), algorithm)
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("partitioned", "own")}
    evals = {name: [r for r in rs if r["phase"] == "eval"] for name, rs in records.items()}
    assert len(evals["own"]) == 2
    # the same clients, data and seeds give the same models (fedavg: evaluated by the server on its
    # partitions of the global copy, and by the nodes on their own data)
    for a, b in zip(evals["partitioned"], evals["own"]):
        for key in ("personalized_accuracy", "personalized_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert own["personalized_accuracy"] == pytest.approx(partitioned["personalized_accuracy"], abs=1e-6)


def test_a_node_without_data_path_or_with_other_inputs_is_refused_at_start(tmp_path):
    rng = np.random.default_rng(7)
    _global_mnist(tmp_path / "global", rng)
    cfg = {"name": "mnist", "root": str(tmp_path / "global"), "cache_dir": str(tmp_path / "cache"), "num_clients": 3}
    dirs = write_partitions(cfg, 0, tmp_path / "nodes")
    with pytest.raises(ConfigError, match=r"SuperNodes of partitions \[2\] have no data-path"):
        _mnist_federation(tmp_path, "mixed", {0: dirs[0], 1: dirs[1]})
    small = tmp_path / "small"  # 20x20 images: not what the run's model takes
    small.mkdir()
    for prefix in ("train", "t10k"):
        _write_idx_gz(small / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (10, 20, 20)))
        _write_idx_gz(small / f"{prefix}-labels-idx1-ubyte.gz", np.arange(10))
    with pytest.raises(ConfigError, match=r"failed their start-up handshake with: ConfigError: node config data-path=.*small.*images have shape \(20, 20\); expected \(28, 28\)"):
        _mnist_federation(tmp_path, "other-shape", {0: dirs[0], 1: dirs[1], 2: small}, client_errors=True)
    assert (tmp_path / "other-shape" / "metrics.jsonl").read_text() == ""  # no round ran


def test_tct_with_own_data_scores_only_the_global_test_set_in_stage_two(tmp_path):
    _global_mnist(tmp_path / "global", np.random.default_rng(8))
    cfg = {"name": "mnist", "root": str(tmp_path / "global"), "cache_dir": str(tmp_path / "cache"), "normalize": False,
           "num_clients": 3, "partition": "pathological", "classes_per_client": 2}
    dirs = write_partitions(cfg, 0, tmp_path / "nodes")
    _mnist_federation(tmp_path, "tct", dict(enumerate(dirs)), "tct", "tct.stage1_rounds=1 tct.features=32 tct.local_steps=2")
    evals = {r["round"]: r for r in map(json.loads, (tmp_path / "tct" / "metrics.jsonl").read_text().splitlines())
             if r["phase"] == "eval"}
    assert evals[1]["personalized_accuracy"] is not None  # stage 1: the nodes evaluate the model themselves
    assert evals[2]["personalized_accuracy"] is None and evals[2]["global_accuracy"] is not None
