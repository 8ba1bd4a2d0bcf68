"""Tests for task.data.sources and task.data.synthetic (dataset loading and validation)."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from task.errors import ConfigError
from task.data.sources import DATASET_NAMES, load_source, read_idx
from task.data.synthetic import make_linear_tasks
from offline_data import shared

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("flrep_cache"))


# ----------------------------------------------------------------------------- helpers to write files


def write_idx(path: Path, arr: np.ndarray, magic: int | None = None, compress: bool = True) -> None:
    arr = np.asarray(arr, dtype=np.uint8)
    magic = 0x0800 + arr.ndim if magic is None else magic
    raw = struct.pack(">I", magic) + struct.pack(">" + "I" * arr.ndim, *arr.shape) + arr.tobytes()
    if compress:
        with gzip.open(path, "wb") as fh:
            fh.write(raw)
    else:
        path.write_bytes(raw)


def write_mnist_set(d: Path, n_train: int = 20, n_test: int = 10, hw=(28, 28)) -> None:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_idx(d / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (n_train, *hw)))
    write_idx(d / "train-labels-idx1-ubyte.gz", np.arange(n_train) % 10)
    write_idx(d / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (n_test, *hw)))
    write_idx(d / "t10k-labels-idx1-ubyte.gz", np.arange(n_test) % 10)


def image_bytes(color, size=(32, 32), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def make_image_tar(path: Path, classes, n_train=3, n_test=2, prefix="", fmt="PNG", bad_member=None,
                   odd_size_member=None) -> None:
    with tarfile.open(path, "w") as tar:
        for split, n in (("train", n_train), ("test", n_test)):
            for ci, cls in enumerate(classes):
                for j in range(n):
                    name = f"{prefix}{split}/{cls}/{j:04d}.{fmt.lower().replace('jpeg', 'jpg')}"
                    if name == bad_member:
                        data = b"not an image"
                    elif name == odd_size_member:
                        data = image_bytes((ci * 20, j * 10, 0), size=(16, 16), fmt=fmt)
                    else:
                        data = image_bytes((ci * 20, j * 10, 0), fmt=fmt)
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------- digits


def test_dataset_names():
    assert set(DATASET_NAMES) == {"digits", "mnist", "fashion_mnist", "cifar10", "cifar100", "femnist", "adult",
                                  "image_folder", "synthetic_linear", "synthetic_quadratic"}


def test_synthetic_quadratic_rows_give_the_client_quadratics():
    """Mean squared error of client i's rows = ½‖A_i^{1/2}(x − c_i)‖² (+ const): (2/d)XᵀX = A_i, y = X c_i."""
    cfg = {"name": "synthetic_quadratic", "num_clients": 3, "quadratic": {"d": 4, "mu": 1.0, "L": 20.0, "C": 2.0}}
    b = load_source(cfg)
    A, c = b.meta["A"], b.meta["c"]
    assert b.task == "regression" and b.input_shape == (4,) and len(b.train.y) == 12
    for i in range(3):
        rows = b.train.group == i
        x, y = b.train.x[rows].astype(np.float64), b.train.y[rows].astype(np.float64)
        np.testing.assert_allclose(2.0 / 4 * x.T @ x, A[i], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x @ c[i], y, rtol=1e-5, atol=1e-5)
        lam = np.linalg.eigvalsh(A[i])
        assert lam[0] == pytest.approx(1.0) and lam[-1] == pytest.approx(20.0)
        assert np.linalg.norm(c[i]) <= 2.0
    with pytest.raises(ConfigError, match="data.quadratic.L"):
        load_source({**cfg, "quadratic": {"mu": 5.0, "L": 1.0}})


def test_digits_shapes_and_normalisation():
    b = load_source({"name": "digits"})
    assert b.train.x.shape == (1347, 1, 8, 8) and b.test.x.shape == (450, 1, 8, 8)
    assert b.train.x.dtype == np.float32 and b.train.y.dtype == np.int64
    assert b.num_classes == 10 and b.input_shape == (1, 8, 8) and b.task == "classification"
    assert abs(float(b.train.x.mean())) < 1e-4 and abs(float(b.train.x.std()) - 1.0) < 1e-3
    # stratified: every class has ~25% of its samples in test
    frac = np.bincount(b.test.y) / (np.bincount(b.test.y) + np.bincount(b.train.y))
    assert np.all(np.abs(frac - 0.25) < 0.02)
    raw = load_source({"name": "digits", "normalize": False})
    assert raw.train.x.min() >= 0.0 and raw.train.x.max() <= 1.0 and raw.train.x.max() == 1.0
    again = load_source({"name": "digits"})
    assert np.array_equal(again.train.y, b.train.y)
    other = load_source({"name": "digits", "split_seed": 1, "test_fraction": 0.5})
    assert len(other.test.y) == 899 and not np.array_equal(other.train.y[:50], b.train.y[:50])


@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"name": "nope"}, "data.name"),
        ({"name": "digits", "normalize": "yes"}, "data.normalize"),
        ({"name": "digits", "test_fraction": 1.5}, "data.test_fraction"),
        ({"name": "digits", "split_seed": -1}, "data.split_seed"),
        ({"name": "mnist", "source": "ftp"}, "data.source"),
        ({"name": "image_folder"}, "data.root"),
        ({"name": "adult", "source": "hub"}, "data.source"),
    ],
)
def test_bad_config_values(cfg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_source(cfg)


def test_missing_root_names_key_and_path(tmp_path):
    missing = tmp_path / "does-not-exist"
    for name in ("mnist", "fashion_mnist", "cifar10", "cifar100", "femnist", "adult", "image_folder"):
        with pytest.raises(ConfigError) as err:
            load_source({"name": name, "root": str(missing)})
        assert "data.root" in str(err.value) and str(missing) in str(err.value)


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_linear_tasks():
    bundle, tr, te, b_star = make_linear_tasks(num_clients=7, d=12, k=3, n_train=400, n_test=50, noise=0.3, seed=5)
    assert b_star.shape == (12, 3)
    np.testing.assert_allclose(b_star.T @ b_star, np.eye(3), atol=1e-10)
    assert bundle.task == "regression" and bundle.num_classes == 1 and bundle.input_shape == (12,)
    assert bundle.train.x.shape == (7 * 400, 12) and bundle.test.x.shape == (7 * 50, 12)
    assert bundle.train.y.shape == (7 * 400,) and bundle.train.y.dtype == np.float32
    assert bundle.train.x.dtype == np.float32
    assert [len(i) for i in tr] == [400] * 7 and [len(i) for i in te] == [50] * 7
    heads = bundle.meta["heads"]
    resid = []
    for i in range(7):
        theta = b_star @ heads[i]
        resid.append(bundle.train.y[tr[i]] - bundle.train.x[tr[i]] @ theta)
        assert np.all(bundle.train.group[tr[i]] == i) and np.all(bundle.test.group[te[i]] == i)
    resid = np.concatenate(resid)
    assert abs(resid.std() - 0.3) < 0.02 and abs(resid.mean()) < 0.03
    again = make_linear_tasks(num_clients=7, d=12, k=3, n_train=400, n_test=50, noise=0.3, seed=5)
    assert np.array_equal(again[0].train.x, bundle.train.x) and np.array_equal(again[3], b_star)
    other = make_linear_tasks(num_clients=7, d=12, k=3, n_train=400, n_test=50, noise=0.3, seed=6)
    assert not np.allclose(other[3], b_star)
    scaled = make_linear_tasks(num_clients=7, d=12, k=3, n_train=4, n_test=5, noise=0.0, seed=5, head_scale=2.0)
    np.testing.assert_allclose(scaled[0].meta["heads"], 2.0 * heads, rtol=1e-6)


def test_synthetic_via_load_source_and_errors():
    b = load_source({"name": "synthetic_linear", "num_clients": 4, "synthetic": {"d": 6, "k": 2, "n_train": 3}})
    assert b.train.x.shape == (12, 6) and b.test.x.shape == (400, 6) and b.task == "regression"
    with pytest.raises(ConfigError, match=r"data\.synthetic\.k"):
        load_source({"name": "synthetic_linear", "synthetic": {"d": 3, "k": 4}})
    with pytest.raises(ConfigError, match=r"data\.synthetic\.noise"):
        load_source({"name": "synthetic_linear", "synthetic": {"noise": -1.0}})
    with pytest.raises(ConfigError, match=r"data\.synthetic"):
        load_source({"name": "synthetic_linear", "synthetic": 3})


# ----------------------------------------------------------------------------- IDX (MNIST)


@pytest.mark.parametrize("layout", ["flat", "MNIST/raw"])
def test_idx_layouts(tmp_path, layout):
    d = tmp_path if layout == "flat" else tmp_path / "MNIST" / "raw"
    write_mnist_set(d)
    b = load_source({"name": "mnist", "root": str(tmp_path), "normalize": False})
    assert b.train.x.shape == (20, 1, 28, 28) and b.test.x.shape == (10, 1, 28, 28)
    assert b.train.y.tolist() == [i % 10 for i in range(20)]
    assert 0.0 <= np.asarray(b.train.x).min() and np.asarray(b.train.x).max() <= 1.0


def test_fashion_idx_layout_uncompressed(tmp_path):
    d = tmp_path / "FashionMNIST" / "raw"
    d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    write_idx(d / "train-images-idx3-ubyte", rng.integers(0, 256, (6, 28, 28)), compress=False)
    write_idx(d / "train-labels-idx1-ubyte", np.arange(6), compress=False)
    write_idx(d / "t10k-images-idx3-ubyte", rng.integers(0, 256, (4, 28, 28)), compress=False)
    write_idx(d / "t10k-labels-idx1-ubyte", np.arange(4), compress=False)
    b = load_source({"name": "fashion_mnist", "root": str(tmp_path)})
    assert b.train.x.shape == (6, 1, 28, 28) and b.meta["class_names"][9] == "Ankle boot"


def test_idx_missing_files(tmp_path):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.root.*IDX"):
        load_source({"name": "mnist", "root": str(tmp_path)})


def test_idx_bad_gzip(tmp_path):
    write_mnist_set(tmp_path)
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(b"this is not gzip data at all")
    with pytest.raises(ConfigError) as err:
        load_source({"name": "mnist", "root": str(tmp_path)})
    assert str(bad) in str(err.value) and "gzip" in str(err.value)


def test_idx_wrong_magic(tmp_path):
    write_mnist_set(tmp_path)
    bad = tmp_path / "train-labels-idx1-ubyte.gz"
    write_idx(bad, np.arange(20) % 10, magic=0x0D01)
    with pytest.raises(ConfigError) as err:
        load_source({"name": "mnist", "root": str(tmp_path)})
    assert str(bad) in str(err.value) and "magic" in str(err.value)


def test_idx_truncated_payload(tmp_path):
    path = tmp_path / "x.gz"
    raw = struct.pack(">IIII", 0x0803, 5, 28, 28) + bytes(100)
    with gzip.open(path, "wb") as fh:
        fh.write(raw)
    with pytest.raises(ConfigError, match="header dims"):
        read_idx(path, 3)


def test_idx_wrong_shapes(tmp_path):
    write_mnist_set(tmp_path, hw=(27, 27))
    with pytest.raises(ConfigError, match=r"train-images-idx3-ubyte\.gz.*expected \(28, 28\)"):
        load_source({"name": "mnist", "root": str(tmp_path)})
    write_mnist_set(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(9) % 10)
    with pytest.raises(ConfigError, match=r"t10k-labels-idx1-ubyte\.gz.*9 labels"):
        load_source({"name": "mnist", "root": str(tmp_path)})


def test_mnist_real_files():
    root = shared("mnist")
    t = time.perf_counter()
    b = load_source({"name": "mnist", "root": str(root)})
    elapsed = time.perf_counter() - t
    assert b.train.x.shape == (60000, 1, 28, 28) and b.test.x.shape == (10000, 1, 28, 28)
    assert np.bincount(b.train.y).tolist()[:2] == [5923, 6742]
    np.testing.assert_allclose(b.meta["mean"], [0.1307], atol=1e-4)
    np.testing.assert_allclose(b.meta["std"], [0.3081], atol=1e-4)
    assert elapsed < 10


def test_fashion_mnist_real_files():
    b = load_source({"name": "fashion_mnist", "root": str(shared("fashion-mnist"))})
    assert b.train.x.shape == (60000, 1, 28, 28) and np.bincount(b.test.y).tolist() == [1000] * 10


# ----------------------------------------------------------------------------- CIFAR pickles / image folders


def write_cifar10_pickles(d: Path, n=4) -> None:
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        obj = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(range(n))}
        with open(d / name, "wb") as fh:
            pickle.dump(obj, fh)


def test_cifar10_pickles(tmp_path):
    write_cifar10_pickles(tmp_path / "cifar-10-batches-py")
    b = load_source({"name": "cifar10", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")})
    assert b.train.x.shape == (20, 3, 32, 32) and b.test.x.shape == (4, 3, 32, 32)
    assert b.meta["class_names"] == CIFAR10_NAMES


def test_a_bad_cifar_label_names_its_batch_file_and_index(tmp_path):
    write_cifar10_pickles(tmp_path / "cifar-10-batches-py")
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_4", "wb") as fh:
        pickle.dump({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 10, 2]}, fh)
    with pytest.raises(ConfigError, match=r"data_batch_4: label 10 at index 2 is outside 0\.\.9"):
        load_source({"name": "cifar10", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")})


def test_cifar100_pickles(tmp_path):
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    for name, n in (("train", 6), ("test", 3)):
        with open(d / name, "wb") as fh:
            pickle.dump({b"data": np.zeros((n, 3072), np.uint8), b"fine_labels": [99] * n, b"coarse_labels": [0] * n}, fh)
    b = load_source({"name": "cifar100", "root": str(d), "cache_dir": str(tmp_path / "c")})
    assert b.num_classes == 100 and b.train.x.shape == (6, 3, 32, 32) and b.train.y.tolist() == [99] * 6


def test_cifar_malformed_pickle(tmp_path):
    write_cifar10_pickles(tmp_path / "cifar-10-batches-py")
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    bad.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="data_batch_3"):
        load_source({"name": "cifar10", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")})
    with open(bad, "wb") as fh:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4}, fh)
    with pytest.raises(ConfigError, match=r"data_batch_3.*\(N, 3072\)"):
        load_source({"name": "cifar10", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")})


def test_cifar10_no_data(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.root.*cifar-10-batches-py"):
        load_source({"name": "cifar10", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")})


@pytest.mark.parametrize("root_is", ["tar_file", "dir_with_tar"])
def test_cifar10_tiny_image_tar(tmp_path, root_is):
    classes = list(reversed(CIFAR10_NAMES))  # written in reverse order: loader must sort
    tar_path = tmp_path / "data" / "tiny.tar"
    tar_path.parent.mkdir()
    make_image_tar(tar_path, classes, n_train=3, n_test=2, fmt="JPEG")
    cache = tmp_path / "cache"
    root = tar_path if root_is == "tar_file" else tar_path.parent
    b = load_source({"name": "cifar10", "root": str(root), "cache_dir": str(cache), "normalize": False})
    assert b.train.x.shape == (30, 3, 32, 32) and b.test.x.shape == (20, 3, 32, 32)
    assert b.meta["class_names"] == CIFAR10_NAMES
    assert np.bincount(b.train.y).tolist() == [3] * 10
    # class "truck" (index 9) was written with red channel 0 (ci=0), "airplane" with 180
    red_by_class = [b.train.x[b.train.y == c, 0].mean() for c in range(10)]
    assert red_by_class[9] < 0.05 and abs(red_by_class[0] - 180 / 255) < 0.05
    files = list((cache / "decoded").glob("imgfolder-*.npz"))
    assert len(files) == 1
    again = load_source({"name": "cifar10", "root": str(root), "cache_dir": str(cache), "normalize": False})
    assert np.array_equal(again.train.x, b.train.x) and np.array_equal(again.test.y, b.test.y)


def test_image_folder_directory_grayscale_and_prefix(tmp_path):
    classes = ["cats", "dogs", "emus"]
    make_image_tar(tmp_path / "a.tar", classes, n_train=2, n_test=1, prefix="top/")
    with tarfile.open(tmp_path / "a.tar") as tar:
        tar.extractall(tmp_path / "extracted")
    root = tmp_path / "extracted" / "top"
    b = load_source({"name": "image_folder", "root": str(root), "image_channels": 1,
                     "cache_dir": str(tmp_path / "c")})
    assert b.num_classes == 3 and b.train.x.shape == (6, 1, 32, 32) and b.meta["class_names"] == classes
    b2 = load_source({"name": "image_folder", "root": str(tmp_path / "a.tar"), "cache_dir": str(tmp_path / "c")})
    assert b2.train.x.shape == (6, 3, 32, 32) and b2.test.y.tolist() == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"data\.image_channels"):
        load_source({"name": "image_folder", "root": str(root), "image_channels": 2})


def test_image_folder_errors(tmp_path):
    bad_tar = tmp_path / "bad" / "x.tar"
    bad_tar.parent.mkdir()
    make_image_tar(bad_tar, ["a", "b"], bad_member="train/b/0001.png")
    with pytest.raises(ConfigError, match=r"train/b/0001\.png.*cannot decode"):
        load_source({"name": "image_folder", "root": str(bad_tar), "cache_dir": str(tmp_path / "c")})
    odd = tmp_path / "odd" / "x.tar"
    odd.parent.mkdir()
    make_image_tar(odd, ["a", "b"], odd_size_member="test/a/0000.png")
    with pytest.raises(ConfigError, match=r"test/a/0000\.png.*same size"):
        load_source({"name": "image_folder", "root": str(odd), "cache_dir": str(tmp_path / "c")})
    nine = tmp_path / "nine" / "x.tar"
    nine.parent.mkdir()
    make_image_tar(nine, CIFAR10_NAMES[:9], n_train=1, n_test=1)
    with pytest.raises(ConfigError, match="expected 10"):
        load_source({"name": "cifar10", "root": str(nine), "cache_dir": str(tmp_path / "c")})
    not_tar = tmp_path / "plain.tar"
    not_tar.write_bytes(b"x" * 600)
    with pytest.raises(ConfigError, match="not a tar"):
        load_source({"name": "image_folder", "root": str(not_tar)})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"data\.root"):
        load_source({"name": "image_folder", "root": str(empty)})


def test_cifar10_real_tar_listing_order():
    tar_path = shared("cifar10-jpeg") / "CIFAR-10-images-jpeg.tar"
    with tarfile.open(tar_path) as tar:
        classes = sorted({m.name.split("/")[1] for m in tar.getmembers() if m.name.count("/") == 2})
    assert classes == CIFAR10_NAMES


@pytest.mark.slow
def test_cifar10_real_tar_full_decode(tmp_path):
    root = shared("cifar10-jpeg")
    cfg = {"name": "cifar10", "root": str(root), "cache_dir": str(tmp_path)}
    t = time.perf_counter()
    b = load_source(cfg)
    first = time.perf_counter() - t
    assert b.train.x.shape == (50000, 3, 32, 32) and b.test.x.shape == (10000, 3, 32, 32)
    assert np.bincount(b.train.y).tolist() == [5000] * 10 and np.bincount(b.test.y).tolist() == [1000] * 10
    np.testing.assert_allclose(b.meta["mean"], [0.491, 0.482, 0.447], atol=0.01)
    t = time.perf_counter()
    load_source(cfg)
    assert time.perf_counter() - t < first


# ----------------------------------------------------------------------------- FEMNIST


def leaf_json(users: dict[str, list[int]], seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "users": list(users),
        "num_samples": [len(v) for v in users.values()],
        "user_data": {u: {"x": rng.random((len(ys), 784)).round(3).tolist(), "y": ys} for u, ys in users.items()},
    }


def test_femnist_toy_json(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "train" / "s0.json").write_text(json.dumps(leaf_json({"w2": [0, 1, 36], "w1": [5, 40], "w9": [3]})))
    (tmp_path / "test" / "s0.json").write_text(json.dumps(leaf_json({"w1": [7], "w2": [37, 2]})))
    cfg = {"name": "femnist", "root": str(tmp_path), "cache_dir": str(tmp_path / "c"), "normalize": False}
    b = load_source(cfg)
    assert b.meta["writers"] == ["w1", "w2"]  # w9 has no test data
    assert b.train.x.shape == (5, 1, 28, 28) and b.test.x.shape == (3, 1, 28, 28)
    assert b.train.group.tolist() == [1, 1, 1, 0, 0] and b.test.group.tolist() == [0, 1, 1]
    assert b.num_classes == 62
    letters = load_source({**cfg, "femnist_classes": "letters"})
    assert letters.num_classes == 10 and letters.meta["writers"] == ["w2"]
    assert letters.train.y.tolist() == [0] and letters.test.y.tolist() == [1]
    digits = load_source({**cfg, "femnist_classes": "digits"})
    assert digits.train.y.tolist() == [0, 1, 5] and digits.meta["writers"] == ["w1", "w2"]
    with pytest.raises(ConfigError, match=r"data\.femnist_classes"):
        load_source({**cfg, "femnist_classes": "vowels"})


def test_femnist_flat_json_names(tmp_path):
    (tmp_path / "all_data_0_niid_05_keep_0_train_9.json").write_text(json.dumps(leaf_json({"a": [1, 2]})))
    (tmp_path / "all_data_0_niid_05_keep_0_test_9.json").write_text(json.dumps(leaf_json({"a": [3]})))
    b = load_source({"name": "femnist", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")})
    assert len(b.train.y) == 2 and len(b.test.y) == 1


def test_femnist_malformed(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    bad = tmp_path / "train" / "s0.json"
    bad.write_text("{not json")
    (tmp_path / "test" / "s0.json").write_text(json.dumps(leaf_json({"a": [3]})))
    cfg = {"name": "femnist", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")}
    with pytest.raises(ConfigError) as err:
        load_source(cfg)
    assert str(bad) in str(err.value) and "json" in str(err.value)
    data = leaf_json({"a": [1]})
    data["user_data"]["a"]["x"] = [[0.0] * 100]
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"s0\.json.*\(n, 784\)"):
        load_source(cfg)
    bad.write_text(json.dumps({"users": []}))
    with pytest.raises(ConfigError, match=r"s0\.json.*user_data"):
        load_source(cfg)
    bad.unlink()
    with pytest.raises(ConfigError, match=r"data\.root.*json"):
        load_source(cfg)


def test_femnist_num_samples_that_disagree_with_user_data_name_the_file_and_user(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    shard = tmp_path / "train" / "s0.json"
    (tmp_path / "test" / "s0.json").write_text(json.dumps(leaf_json({"a": [3], "b": [4]})))
    cfg = {"name": "femnist", "root": str(tmp_path), "cache_dir": str(tmp_path / "c")}
    data = leaf_json({"a": [1, 2], "b": [5]})
    data["num_samples"] = [2, 3]
    shard.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"s0\.json: num_samples gives 3 samples for user 'b', its user_data holds 1"):
        load_source(cfg)
    data["num_samples"] = [2]
    shard.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"s0\.json: num_samples has 1 entries for 2 users"):
        load_source(cfg)


def test_femnist_real_shards(module_cache):
    root = shared("femnist")
    b = load_source({"name": "femnist", "root": str(root), "cache_dir": module_cache})
    assert len(b.meta["writers"]) == 110
    assert len(b.train.y) == 14697 and len(b.test.y) == 1695
    assert b.train.x.shape[1:] == (1, 28, 28) and b.num_classes == 62
    assert set(np.unique(b.train.group)) == set(np.unique(b.test.group)) == set(range(110))


# ----------------------------------------------------------------------------- Adult


ADULT_ROW = "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K"


def test_adult_real_files():
    root = shared("adult")
    b = load_source({"name": "adult", "root": str(root)})
    assert len(b.train.y) == 32561 and len(b.test.y) == 16281
    assert b.train.x.dtype == np.float32 and b.input_shape == (b.train.x.shape[1],)
    assert set(b.train.attributes) == set(b.test.attributes) == {"race", "sex"}
    assert b.meta["attribute_categories"]["sex"] == ["Female", "Male"]
    assert 0.23 < b.train.y.mean() < 0.25 and 0.23 < b.test.y.mean() < 0.25
    np.testing.assert_allclose(b.train.x[:, :6].mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(b.train.x[:, :6].std(axis=0), 1, atol=1e-3)
    # one-hot blocks: each of the 8 categorical columns sums to one per train row
    assert np.allclose(b.train.x[:, 6:].sum(axis=1), 8)
    dropped = load_source({"name": "adult", "root": str(root), "adult_missing": "drop"})
    assert len(dropped.train.y) == 30162 and len(dropped.test.y) == 15060
    no_prot = load_source({"name": "adult", "root": str(root), "adult_include_protected": False})
    assert no_prot.train.x.shape[1] == b.train.x.shape[1] - 7
    assert np.array_equal(no_prot.train.attributes["race"], b.train.attributes["race"])


def test_adult_malformed(tmp_path):
    (tmp_path / "adult.data").write_text(ADULT_ROW + "\n" + ADULT_ROW.replace("<=50K", ">50K") + "\n\n")
    (tmp_path / "adult.test").write_text("|1x3 Cross validator\n" + ADULT_ROW + ".\n")
    b = load_source({"name": "adult", "root": str(tmp_path)})
    assert b.train.y.tolist() == [0, 1] and b.test.y.tolist() == [0]
    (tmp_path / "adult.test").write_text("|1x3 Cross validator\n" + ADULT_ROW.replace("<=50K", "maybe") + "\n")
    with pytest.raises(ConfigError, match=r"adult\.test:2: income label"):
        load_source({"name": "adult", "root": str(tmp_path)})
    (tmp_path / "adult.test").write_text("1, 2, 3\n")
    with pytest.raises(ConfigError, match=r"adult\.test:1: 3 fields"):
        load_source({"name": "adult", "root": str(tmp_path)})
    (tmp_path / "adult.test").write_text(ADULT_ROW.replace("39", "old") + "\n")
    with pytest.raises(ConfigError, match=r"adult\.test:1: non-numeric"):
        load_source({"name": "adult", "root": str(tmp_path)})
    (tmp_path / "adult.test").unlink()
    with pytest.raises(ConfigError, match=r"adult\.test: file not found"):
        load_source({"name": "adult", "root": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"data\.adult_missing"):
        load_source({"name": "adult", "root": str(tmp_path), "adult_missing": "impute"})


# ----------------------------------------------------------------------------- Hub (mocked; no network here)


def test_hub_failure_is_config_error(monkeypatch, tmp_path):
    import datasets

    def boom(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(ConfigError) as err:
        load_source({"name": "mnist", "source": "hub", "cache_dir": str(tmp_path)})
    msg = str(err.value)
    assert "data.source" in msg and "data.hub_id='ylecun/mnist'" in msg and "no route to huggingface.co" in msg
    assert "data.source=local (the data home's folder after `flrep data fetch mnist`, or data.root)" in msg
    with pytest.raises(ConfigError, match=r"data\.hub_id='me/other'"):
        load_source({"name": "cifar10", "source": "hub", "hub_id": "me/other", "cache_dir": str(tmp_path)})


def test_hub_conversion_mocked(monkeypatch, tmp_path):
    import datasets
    from PIL import Image

    def fake(path=None, name=None, cache_dir=None, **kwargs):
        assert path == "uoft-cs/cifar10" and cache_dir.startswith(str(tmp_path))
        feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR10_NAMES)})

        def split(n):
            imgs = [Image.new("RGB", (32, 32), (i * 20, 0, 0)) for i in range(n)]
            return datasets.Dataset.from_dict({"img": imgs, "label": [i % 10 for i in range(n)]}, features=feats)

        return datasets.DatasetDict({"train": split(10), "test": split(5)})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    b = load_source({"name": "cifar10", "source": "hub", "cache_dir": str(tmp_path), "normalize": False})
    assert b.train.x.shape == (10, 3, 32, 32) and b.test.y.tolist() == [0, 1, 2, 3, 4]
    assert b.meta["class_names"] == CIFAR10_NAMES
    assert abs(b.train.x[3, 0].mean() - 60 / 255) < 1e-6


def test_hub_femnist_mocked(monkeypatch, tmp_path):
    import datasets
    from PIL import Image

    def fake(path=None, name=None, cache_dir=None, **kwargs):
        n = 40
        imgs = [Image.new("L", (28, 28), i) for i in range(n)]
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict(
            {"image": imgs, "writer_id": [f"f{i % 4:04d}" for i in range(n)], "hsf_id": [0] * n,
             "character": [i % 62 for i in range(n)]},
            features=datasets.Features({"image": datasets.Image(), "writer_id": datasets.Value("string"),
                                        "hsf_id": datasets.Value("int64"),
                                        "character": datasets.ClassLabel(num_classes=62)}))})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    b = load_source({"name": "femnist", "source": "hub", "cache_dir": str(tmp_path)})
    assert len(b.meta["writers"]) == 4 and len(b.train.y) + len(b.test.y) == 40
    assert np.bincount(b.test.group).tolist() == [1, 1, 1, 1]  # 10% of 10 samples per writer


def test_uint8_images_stay_uint8_and_read_exactly_as_the_eager_float_conversion():
    """ImageArray: a quarter of the memory, the same float32 values (bit for bit) as converting and
    standardising the whole array, for the whole array, any subset and a client's tensors."""
    import torch

    from task.data.datasets.images import ImageArray, image_bundle, normalize_images
    from task.learning.engine import TensorData

    rng = np.random.default_rng(0)
    xtr = rng.integers(0, 256, size=(40, 6, 5, 3), dtype=np.uint8)  # (N, H, W, C) as decoded
    xte = rng.integers(0, 256, size=(10, 6, 5, 3), dtype=np.uint8)
    bundle = image_bundle(xtr, np.zeros(40), xte, np.zeros(10), 2)
    normalize_images(bundle)
    assert isinstance(bundle.train.x, ImageArray) and bundle.train.x.raw.dtype == np.uint8
    assert bundle.input_shape == (3, 6, 5)
    eager = np.transpose(xtr, (0, 3, 1, 2)).astype(np.float32) * np.float32(1 / 255)
    mean = eager.mean(axis=(0, 2, 3), dtype=np.float64)
    std = np.sqrt([np.mean((eager[:, c].astype(np.float64) - mean[c]) ** 2) for c in range(3)])
    np.testing.assert_allclose(bundle.meta["mean"], mean, rtol=1e-6)
    np.testing.assert_allclose(bundle.meta["std"], std, rtol=1e-6)
    eager = (eager - bundle.meta["mean"][None, :, None, None]) / bundle.meta["std"][None, :, None, None]
    assert np.array_equal(np.asarray(bundle.train.x), eager)
    idx = np.array([3, 0, 39, 3])
    assert np.array_equal(bundle.train.x[idx], eager[idx])
    stored = TensorData.stored_images(bundle.train.x, bundle.train.y, torch.device("cpu"))
    assert stored.x.dtype == torch.uint8
    assert torch.equal(stored.subset(torch.as_tensor(idx)).x, torch.from_numpy(eager[idx]))


def test_cache_members_are_memory_mapped_copy_on_write(tmp_path, monkeypatch):
    """Large uncompressed cache arrays are shared file pages; writing one changes neither the
    file nor another load; small, string and empty members load as ordinary arrays."""
    from task.data.datasets import cache

    monkeypatch.setattr(cache, "MMAP_MIN_BYTES", 1000)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    fortran = np.asfortranarray(rng.random((30, 20), dtype=np.float32))
    path = tmp_path / "c.npz"
    assert cache.save_npz_atomic(path, images=images, fortran=fortran, names=np.array(["a", "bb"]),
                                 empty=np.zeros((0, 3)), small=images[:1])
    first = cache.load_npz(path)
    assert isinstance(first["images"], np.memmap) and isinstance(first["fortran"], np.memmap)
    assert not isinstance(first["small"], np.memmap) and not isinstance(first["names"], np.memmap)
    assert np.array_equal(first["images"], images) and np.array_equal(first["fortran"], fortran)
    assert first["names"].tolist() == ["a", "bb"] and first["empty"].shape == (0, 3)
    first["images"][0] += 1  # copy-on-write: private to this load
    assert np.array_equal(cache.load_npz(path)["images"], images)
    assert np.array_equal(np.load(path)["images"], images)
    path.write_bytes(path.read_bytes()[:200])  # a truncated cache reads as missing
    assert cache.load_npz(path) is None
