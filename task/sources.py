"""Dataset sources: load a whole dataset (train + test) into numpy arrays.

``load_source(data_cfg)`` turns the ``data:`` section of the run config into a
:class:`DataBundle`. No Flower import here; partitioning lives in :mod:`task.partition`.

Config keys (all under ``data.``)
---------------------------------
``name``
    One of :data:`DATASET_NAMES`: ``digits``, ``mnist``, ``fashion_mnist``, ``cifar10``,
    ``cifar100``, ``femnist``, ``adult``, ``image_folder``, ``synthetic_linear``. Required.
``source``
    ``local`` (default) or ``hub``. ``hub`` loads ``data.hub_id`` with
    flwr-datasets' ``FederatedDataset`` (whole splits, our own partitioning) and needs network
    access on first use; it is available for mnist, fashion_mnist, cifar10, cifar100 and
    femnist. ``digits`` and ``synthetic_linear`` ignore it (they need no files).
``root``
    Directory (or, for image-folder layouts, a ``.tar`` file) holding the local files.
    Required for local mnist, fashion_mnist, cifar10, cifar100, femnist, adult and
    image_folder; ignored for digits and synthetic_linear. Accepted layouts:

    * mnist / fashion_mnist: the four IDX files ``train-images-idx3-ubyte``,
      ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``
      (each gzip-compressed ``.gz`` or plain) directly in ``root`` or in
      ``root/MNIST/raw`` (``root/FashionMNIST/raw``).
    * cifar10 / cifar100: the python pickles ``cifar-10-batches-py/`` (``data_batch_1..5``,
      ``test_batch``) / ``cifar-100-python/`` (``train``, ``test``; fine labels), under
      ``root`` or ``root`` itself; otherwise an image-folder layout (below) with 10 / 100
      classes, e.g. the JPEG re-encoding ``CIFAR-10-images-jpeg.tar``.
    * image_folder (and the cifar fallback): ``train/<class>/*.{jpg,jpeg,png}`` and
      ``test/<class>/*``, either as a directory, as a ``.tar`` file given as ``root``, or
      as the single ``.tar`` file inside the ``root`` directory. Classes are the sorted
      names of the ``train/`` class folders (for CIFAR-10 that is the standard order
      airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck); all images
      must have the same size. Decoded arrays are cached as ``.npz`` in ``cache_dir``
      keyed by a hash of (path, size, mtime) of the tar / every image file.
    * femnist: LEAF json shards; either ``root/train/*.json`` and ``root/test/*.json`` or
      ``*.json`` files directly in ``root`` with ``_train_`` / ``_test_`` in their names.
      Parsed shards are cached as ``.npz`` in ``cache_dir`` like image folders.
    * adult: UCI ``adult.data`` and ``adult.test`` in ``root``.
``hub_id``
    Optional Hub dataset id; defaults: mnist ``ylecun/mnist``, fashion_mnist
    ``zalando-datasets/fashion_mnist``, cifar10 ``uoft-cs/cifar10``, cifar100
    ``uoft-cs/cifar100``, femnist ``flwrlabs/femnist``.
``cache_dir``
    Directory for decoded-array caches, Hub downloads and partition caches. Default
    ``~/.cache/flrep``. If it cannot be written, caching is skipped (with a warning).
``normalize``
    Bool, default ``true``. Images are first scaled to [0, 1]; with ``normalize`` they
    are then standardised with the per-channel mean/std of the *train* split (stored in
    ``bundle.meta["mean"]`` / ``["std"]``). For adult it standardises the numeric columns
    with train mean/std. synthetic_linear ignores it.
``split_seed``
    Int, default 0: seed of the digits stratified train/test split and of the
    per-writer split of Hub FEMNIST (which has a single split).
``test_fraction``
    Float in (0, 1), default 0.25: digits test fraction.
``femnist_classes``
    ``all`` (default; 62 classes, LEAF coding 0-9 digits, 10-35 ``A``-``Z``, 36-61
    ``a``-``z``), ``digits`` (LEAF labels 0-9, kept as 0-9) or ``letters`` (the 10
    handwritten lowercase letters ``a``-``j``, LEAF labels 36-45, remapped to 0-9; our
    reading of FedRep's "10 handwritten letters"). Only writers that have samples in both
    train and test after this filter are kept; ``group`` is the writer's index in the
    sorted list of kept writer ids (``bundle.meta["writers"]``).
``femnist_test_fraction``
    Float in (0, 1), default 0.1: per-writer test fraction for Hub FEMNIST only (the
    Hub copy has no test split; LEAF uses 0.9/0.1 per writer).
``image_channels``
    1 or 3 (default 3): colour mode images of ``image_folder`` are converted to.
``adult_missing``
    ``keep`` (default; a ``?`` is its own category, so all 32,561 / 16,281 rows are kept)
    or ``drop`` (rows with any ``?`` are removed: 30,162 / 15,060 rows).
``adult_include_protected``
    Bool, default ``true``: whether the one-hot ``race`` and ``sex`` columns are part of
    the adult features. They are always returned in ``ArrayData.attributes``.
``synthetic``
    Sub-section for synthetic_linear (see :mod:`task.synthetic`): ``d`` (20), ``k`` (2),
    ``n_train`` (10 per client), ``n_test`` (100 per client), ``noise`` (0.01, std),
    ``head_scale`` (1.0), ``seed`` (0). The number of tasks is ``data.num_clients``
    (default 100); ``group`` is the task (client) id.

Adult encoding: features are the 6 numeric columns (age, fnlwgt, education-num,
capital-gain, capital-loss, hours-per-week), then the one-hot encodings of workclass,
education, marital-status, occupation, relationship, race, sex, native-country, with each
column's category set taken (sorted) from the train file; unseen test categories encode as
all zeros. Label 1 means income ``>50K``. ``ArrayData.attributes`` holds ``race`` and
``sex`` as int64 codes indexing ``bundle.meta["attribute_categories"][attr]`` (-1 for a
category not seen in train).

Every bad value or file raises :class:`task.errors.ConfigError` naming the key or file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import pickle
import struct
import tarfile
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from task.errors import ConfigError

DATASET_NAMES: tuple[str, ...] = (
    "digits",
    "mnist",
    "fashion_mnist",
    "cifar10",
    "cifar100",
    "femnist",
    "adult",
    "image_folder",
    "synthetic_linear",
)

HUB_DEFAULTS: dict[str, str] = {
    "mnist": "ylecun/mnist",
    "fashion_mnist": "zalando-datasets/fashion_mnist",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "femnist": "flwrlabs/femnist",
}

DEFAULT_CACHE_DIR = "~/.cache/flrep"
_CACHE_VERSION = 1
_IMAGE_EXTS = (".jpg", ".jpeg", ".png")


@dataclass
class ArrayData:
    """One split of a dataset as numpy arrays.

    ``x``: float32, (N, C, H, W) for images, (N, D) for tabular/synthetic, normalised.
    ``y``: int64 class labels (float32 targets for regression).
    ``group``: per-sample natural id (int64), e.g. FEMNIST writer index, else None.
    ``attributes``: extra per-sample int64 arrays (adult: ``race``, ``sex``), else None.
    """

    x: np.ndarray
    y: np.ndarray
    group: np.ndarray | None = None
    attributes: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class DataBundle:
    """Train and test splits plus dataset-level facts.

    ``meta`` holds optional extras: ``class_names``, ``mean``/``std`` (normalisation),
    ``writers`` (FEMNIST), ``feature_names``/``attribute_categories`` (adult),
    ``B_star``/``heads`` (synthetic_linear).
    """

    train: ArrayData
    test: ArrayData
    num_classes: int
    input_shape: tuple[int, ...]
    task: str = "classification"
    meta: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- config helpers


def cfg_get(cfg: Mapping | None, key: str, default: Any = None) -> Any:
    """``cfg[key]`` if present and not None, else ``default`` (works for DictConfig)."""
    if cfg is None:
        return default
    value = cfg.get(key, default)
    return default if value is None else value


def to_plain(obj: Any) -> Any:
    """Recursively convert Mappings/Sequences (e.g. OmegaConf containers) to dict/list."""
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, Sequence):
        return [to_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return obj


def get_int(cfg: Mapping | None, key: str, default: int | None, *, lo: int | None = None,
            hi: int | None = None, prefix: str = "data.") -> int | None:
    """Validated int config value; ``None`` stays None when the default is None."""
    value = cfg_get(cfg, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected an integer")
    value = int(value)
    if lo is not None and value < lo:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected an integer >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected an integer <= {hi}")
    return value


def get_float(cfg: Mapping | None, key: str, default: float, *, gt: float | None = None,
              ge: float | None = None, lt: float | None = None, prefix: str = "data.") -> float:
    """Validated finite float config value."""
    value = cfg_get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a finite number")
    if gt is not None and not value > gt:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a number > {gt}")
    if ge is not None and not value >= ge:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a number >= {ge}")
    if lt is not None and not value < lt:
        raise ConfigError(f"{prefix}{key}={value} is invalid: expected a number < {lt}")
    return value


def get_bool(cfg: Mapping | None, key: str, default: bool, prefix: str = "data.") -> bool:
    value = cfg_get(cfg, key, default)
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected true or false")
    return bool(value)


def get_choice(cfg: Mapping | None, key: str, default: str, choices: Sequence[str],
               prefix: str = "data.") -> str:
    value = cfg_get(cfg, key, default)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{prefix}{key}={value!r} is invalid: expected one of {', '.join(choices)}"
        )
    return value


def cache_dir_from_cfg(data_cfg: Mapping | None) -> Path:
    value = cfg_get(data_cfg, "cache_dir", DEFAULT_CACHE_DIR)
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"data.cache_dir={value!r} is invalid: expected a directory path")
    return Path(os.path.expanduser(os.fspath(value)))


# ----------------------------------------------------------------------------- npz cache


def save_npz_atomic(path: Path, **arrays: np.ndarray) -> bool:
    """Write ``arrays`` to ``path`` atomically; return False (and warn) if impossible."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except OSError as exc:
        warnings.warn(f"could not write cache file {path}: {exc}", stacklevel=2)
        return False


def load_npz(path: Path) -> dict[str, np.ndarray] | None:
    """Load a cache ``.npz`` fully into memory; None if missing or unreadable."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except Exception:  # noqa: BLE001 - a corrupt cache is just rebuilt
        return None


def _hash_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _file_stamp(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


# ----------------------------------------------------------------------------- entry point


def load_source(data_cfg: Mapping) -> DataBundle:
    """Load the dataset described by ``data_cfg`` (the ``data:`` config section)."""
    if not isinstance(data_cfg, Mapping):
        raise ConfigError(f"data: expected a mapping of data options, got {type(data_cfg).__name__}")
    name = cfg_get(data_cfg, "name", None)
    if name not in DATASET_NAMES:
        raise ConfigError(f"data.name={name!r} is invalid: expected one of {', '.join(DATASET_NAMES)}")
    source = get_choice(data_cfg, "source", "local", ("local", "hub"))
    normalize = get_bool(data_cfg, "normalize", True)
    cache_dir = cache_dir_from_cfg(data_cfg)

    if name == "digits":
        return _load_digits(data_cfg, normalize)
    if name == "synthetic_linear":
        from task.synthetic import bundle_from_cfg

        return bundle_from_cfg(data_cfg)
    if source == "hub":
        if name not in HUB_DEFAULTS:
            raise ConfigError(
                f"data.source='hub' is not supported for data.name={name!r}: use data.source=local "
                f"(hub is available for {', '.join(HUB_DEFAULTS)})"
            )
        return _load_hub(name, data_cfg, cache_dir, normalize)

    root = _root_from_cfg(data_cfg, name)
    if name in ("mnist", "fashion_mnist"):
        bundle = _load_idx_dataset(name, root)
    elif name in ("cifar10", "cifar100"):
        bundle = _load_cifar(name, root, data_cfg, cache_dir)
    elif name == "image_folder":
        bundle = _load_image_folder(root, data_cfg, cache_dir, expected_classes=None)
    elif name == "femnist":
        bundle = _load_femnist_local(root, data_cfg, cache_dir)
    elif name == "adult":
        return _load_adult(root, data_cfg, normalize)
    else:  # pragma: no cover - guarded by DATASET_NAMES
        raise ConfigError(f"data.name={name!r} is not implemented")
    if normalize:
        normalize_images(bundle)
    return bundle


def _root_from_cfg(data_cfg: Mapping, name: str) -> Path:
    value = cfg_get(data_cfg, "root", None)
    if value is None or value == "":
        raise ConfigError(
            f"data.root is required for data.name={name!r} with data.source=local: "
            "set it to the directory holding the dataset files"
        )
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"data.root={value!r} is invalid: expected a directory path")
    root = Path(os.path.expanduser(os.fspath(value)))
    if not root.exists():
        raise ConfigError(f"data.root={str(root)!r} does not exist: expected the directory holding the {name} files")
    return root


# ----------------------------------------------------------------------------- image helpers


def images_to_float(x_uint8: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) uint8 -> float32 (N, C, H, W) in [0, 1]."""
    if x_uint8.ndim == 3:
        x_uint8 = x_uint8[:, None, :, :]
    else:
        x_uint8 = np.transpose(x_uint8, (0, 3, 1, 2))
    out = np.empty(x_uint8.shape, dtype=np.float32)
    np.multiply(x_uint8, np.float32(1.0 / 255.0), out=out, casting="unsafe")
    return out


def normalize_images(bundle: DataBundle) -> None:
    """In place: standardise (N, C, H, W) images with per-channel train mean/std."""
    xtr = bundle.train.x
    if xtr.ndim != 4:
        return
    mean = xtr.mean(axis=(0, 2, 3), dtype=np.float64)
    var = np.zeros_like(mean)
    for c in range(xtr.shape[1]):
        var[c] = np.mean((xtr[:, c].astype(np.float64) - mean[c]) ** 2)
    std = np.sqrt(var)
    std[std < 1e-12] = 1.0
    m = mean.astype(np.float32)[None, :, None, None]
    s = std.astype(np.float32)[None, :, None, None]
    for arr in (bundle.train.x, bundle.test.x):
        arr -= m
        arr /= s
    bundle.meta["mean"] = mean.astype(np.float32)
    bundle.meta["std"] = std.astype(np.float32)


def _image_bundle(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                  num_classes: int, class_names: Sequence[str] | None = None,
                  g_train: np.ndarray | None = None, g_test: np.ndarray | None = None) -> DataBundle:
    xtr = x_train if x_train.dtype == np.float32 and x_train.ndim == 4 else images_to_float(x_train)
    xte = x_test if x_test.dtype == np.float32 and x_test.ndim == 4 else images_to_float(x_test)
    meta: dict[str, Any] = {}
    if class_names is not None:
        meta["class_names"] = list(class_names)
    return DataBundle(
        train=ArrayData(xtr, np.asarray(y_train, dtype=np.int64), g_train),
        test=ArrayData(xte, np.asarray(y_test, dtype=np.int64), g_test),
        num_classes=int(num_classes),
        input_shape=tuple(int(s) for s in xtr.shape[1:]),
        meta=meta,
    )


# ----------------------------------------------------------------------------- digits


def _load_digits(data_cfg: Mapping, normalize: bool) -> DataBundle:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    test_fraction = get_float(data_cfg, "test_fraction", 0.25, gt=0.0, lt=1.0)
    split_seed = get_int(data_cfg, "split_seed", 0, lo=0)
    digits = load_digits()
    x = (digits.images.astype(np.float32) / np.float32(16.0))[:, None, :, :]
    y = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=test_fraction, random_state=split_seed, stratify=y
    )
    idx_train.sort()
    idx_test.sort()
    bundle = _image_bundle(x[idx_train], y[idx_train], x[idx_test], y[idx_test], 10,
                           [str(i) for i in range(10)])
    if normalize:
        normalize_images(bundle)
    return bundle


# ----------------------------------------------------------------------------- IDX (MNIST)

_IDX_FILES = {
    "train_images": ("train-images-idx3-ubyte", 3),
    "train_labels": ("train-labels-idx1-ubyte", 1),
    "test_images": ("t10k-images-idx3-ubyte", 3),
    "test_labels": ("t10k-labels-idx1-ubyte", 1),
}
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot")


def read_idx(path: Path, expected_ndim: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file (gzip-compressed if it ends in ``.gz``)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc}); expected a gzip-compressed IDX file") from exc
    expected_magic = 0x00000800 + expected_ndim
    if len(raw) < 4:
        raise ConfigError(f"{path}: file too short for an IDX header; expected magic 0x{expected_magic:08x}")
    magic = struct.unpack(">I", raw[:4])[0]
    if magic != expected_magic:
        raise ConfigError(
            f"{path}: wrong IDX magic number 0x{magic:08x}; expected 0x{expected_magic:08x} "
            f"(unsigned bytes, {expected_ndim} dimension(s))"
        )
    header = 4 + 4 * expected_ndim
    if len(raw) < header:
        raise ConfigError(f"{path}: truncated IDX header; expected {expected_ndim} dimension sizes")
    dims = struct.unpack(">" + "I" * expected_ndim, raw[4:header])
    n_expected = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != n_expected:
        raise ConfigError(
            f"{path}: IDX payload has {len(raw) - header} bytes but the header dims {dims} need {n_expected}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx_dir(name: str, root: Path) -> dict[str, Path]:
    sub = "MNIST" if name == "mnist" else "FashionMNIST"
    candidates = [root, root / sub / "raw", root / "raw"]
    for d in candidates:
        found = {}
        for key, (stem, _) in _IDX_FILES.items():
            for fname in (stem + ".gz", stem):
                if (d / fname).is_file():
                    found[key] = d / fname
                    break
        if len(found) == len(_IDX_FILES):
            return found
    names = ", ".join(stem + "[.gz]" for stem, _ in _IDX_FILES.values())
    raise ConfigError(
        f"data.root={str(root)!r}: no complete set of {name} IDX files ({names}) found in "
        + ", ".join(str(c) for c in candidates)
    )


def _load_idx_dataset(name: str, root: Path) -> DataBundle:
    files = _find_idx_dir(name, root)
    arrays = {key: read_idx(path, _IDX_FILES[key][1]) for key, path in files.items()}
    for split in ("train", "test"):
        imgs, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if imgs.shape[1:] != (28, 28):
            raise ConfigError(f"{files[f'{split}_images']}: images have shape {imgs.shape[1:]}; expected (28, 28)")
        if labels.shape[0] != imgs.shape[0]:
            raise ConfigError(
                f"{files[f'{split}_labels']}: {labels.shape[0]} labels but "
                f"{files[f'{split}_images']} has {imgs.shape[0]} images; expected equal counts"
            )
        if labels.size and labels.max() > 9:
            raise ConfigError(f"{files[f'{split}_labels']}: label {int(labels.max())} found; expected labels 0-9")
    names = [str(i) for i in range(10)] if name == "mnist" else list(FASHION_CLASSES)
    return _image_bundle(arrays["train_images"], arrays["train_labels"], arrays["test_images"],
                         arrays["test_labels"], 10, names)


# ----------------------------------------------------------------------------- CIFAR

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def _unpickle(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as fh:
            obj = pickle.load(fh, encoding="bytes")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise ConfigError(f"{path}: cannot unpickle it ({type(exc).__name__}: {exc}); expected a CIFAR python pickle") from exc
    if not isinstance(obj, dict) or b"data" not in obj or label_key not in obj:
        raise ConfigError(f"{path}: expected a dict with keys b'data' and {label_key!r}")
    data = np.asarray(obj[b"data"])
    labels = np.asarray(obj[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
        raise ConfigError(
            f"{path}: 'data' has shape {data.shape} ({data.dtype}) for {labels.shape[0]} labels; "
            "expected uint8 (N, 3072) with one label per row"
        )
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def _load_cifar(name: str, root: Path, data_cfg: Mapping, cache_dir: Path) -> DataBundle:
    if name == "cifar10":
        sub, train_files, test_files, key, ncls = (
            "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels", 10)
    else:
        sub, train_files, test_files, key, ncls = ("cifar-100-python", ["train"], ["test"], b"fine_labels", 100)
    for d in (root / sub, root):
        if d.is_dir() and all((d / f).is_file() for f in train_files + test_files):
            parts_tr = [_unpickle(d / f, key) for f in train_files]
            parts_te = [_unpickle(d / f, key) for f in test_files]
            xtr = np.concatenate([p[0] for p in parts_tr])
            ytr = np.concatenate([p[1] for p in parts_tr])
            xte = np.concatenate([p[0] for p in parts_te])
            yte = np.concatenate([p[1] for p in parts_te])
            for f, y in ((d / train_files[0], ytr), (d / test_files[0], yte)):
                if y.size and (y.min() < 0 or y.max() >= ncls):
                    raise ConfigError(f"{f}: labels outside 0..{ncls - 1}")
            names = list(CIFAR10_CLASSES) if name == "cifar10" else None
            return _image_bundle(xtr, ytr, xte, yte, ncls, names)
    try:
        folder = find_image_folder(root)
    except ConfigError as exc:
        raise ConfigError(
            f"data.root={str(root)!r}: no {name} data found; expected {sub}/ with "
            f"{', '.join(train_files + test_files)} (under data.root or data.root itself) "
            f"or an image-folder layout (train/<class>/*.jpg, test/<class>/*.jpg, as a directory "
            f"or .tar). ({exc})"
        ) from None
    return _load_image_folder(folder, data_cfg, cache_dir, expected_classes=ncls, channels=3)


# ----------------------------------------------------------------------------- image folder


def find_image_folder(root: Path) -> Path:
    """Resolve ``root`` to an image-folder directory or a ``.tar`` file."""
    if root.is_file():
        if tarfile.is_tarfile(root):
            return root
        raise ConfigError(f"{root}: not a tar archive; expected a .tar of train/<class>/* and test/<class>/*")
    if (root / "train").is_dir() and (root / "test").is_dir():
        return root
    tars = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(".tar"))
    if len(tars) == 1:
        return tars[0]
    if len(tars) > 1:
        raise ConfigError(
            f"data.root={str(root)!r} holds several .tar files ({', '.join(t.name for t in tars)}); "
            "set data.root to the one to use"
        )
    raise ConfigError(
        f"data.root={str(root)!r}: expected train/ and test/ class folders or a single .tar file holding them"
    )


def _split_class_from_parts(parts: Sequence[str]) -> tuple[str, str] | None:
    if len(parts) < 3 or parts[-3] not in ("train", "test"):
        return None
    if parts[-1].startswith(".") or not parts[-1].lower().endswith(_IMAGE_EXTS):
        return None
    return parts[-3], parts[-2]


def _decode_image(data: bytes | Path, where: str, mode: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return np.asarray(im.convert(mode), dtype=np.uint8)
    except Exception as exc:  # noqa: BLE001 - PIL raises many error types
        raise ConfigError(f"{where}: cannot decode image ({type(exc).__name__}: {exc}); expected a JPEG/PNG file") from exc


def _collect_image_entries(folder: Path) -> tuple[list[tuple[str, str, str]], list]:
    """Sorted (split, class, name) entries and a stamp list for the cache key."""
    entries: list[tuple[str, str, str]] = []
    if folder.is_file():
        try:
            with tarfile.open(folder) as tar:
                for m in tar.getmembers():
                    if not m.isfile():
                        continue
                    sc = _split_class_from_parts(m.name.split("/"))
                    if sc:
                        entries.append((sc[0], sc[1], m.name))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ConfigError(f"{folder}: cannot read the tar archive ({exc})") from exc
        stamp = [_file_stamp(folder)]
    else:
        stamp = [str(folder.resolve())]
        for split in ("train", "test"):
            for cls_dir in sorted(p for p in (folder / split).iterdir() if p.is_dir()):
                for f in sorted(cls_dir.iterdir()):
                    if f.is_file() and not f.name.startswith(".") and f.name.lower().endswith(_IMAGE_EXTS):
                        entries.append((split, cls_dir.name, str(f)))
                        st = f.stat()
                        stamp.append([f"{split}/{cls_dir.name}/{f.name}", st.st_size, st.st_mtime_ns])
    entries.sort(key=lambda e: (e[0], e[1], Path(e[2]).name, e[2]))
    return entries, stamp


def _load_image_folder(root: Path, data_cfg: Mapping, cache_dir: Path, expected_classes: int | None,
                       channels: int | None = None) -> DataBundle:
    folder = find_image_folder(root)
    if channels is None:
        channels = get_int(data_cfg, "image_channels", 3, lo=1, hi=3)
        if channels == 2:
            raise ConfigError("data.image_channels=2 is invalid: expected 1 or 3")
    mode = "RGB" if channels == 3 else "L"
    entries, stamp = _collect_image_entries(folder)
    key = _hash_key("imgfolder", _CACHE_VERSION, mode, stamp)
    cache_file = cache_dir / "decoded" / f"imgfolder-{key[:32]}.npz"
    cached = load_npz(cache_file)
    if cached is not None:
        classes = [str(c) for c in cached["classes"]]
        xtr, ytr, xte, yte = cached["x_train"], cached["y_train"], cached["x_test"], cached["y_test"]
    else:
        classes = sorted({c for s, c, _ in entries if s == "train"})
        test_classes = sorted({c for s, c, _ in entries if s == "test"})
        if not classes:
            raise ConfigError(f"{folder}: no images found under train/<class>/; expected *.jpg/*.jpeg/*.png files")
        if not test_classes:
            raise ConfigError(f"{folder}: no images found under test/<class>/; expected *.jpg/*.jpeg/*.png files")
        unknown = sorted(set(test_classes) - set(classes))
        if unknown:
            raise ConfigError(f"{folder}: test classes {unknown} have no train/ folder; expected the same class folders")
        cls_index = {c: i for i, c in enumerate(classes)}
        images: list[np.ndarray] = []
        if folder.is_file():
            with tarfile.open(folder) as tar:
                members = {m.name: m for m in tar.getmembers() if m.isfile()}
                for _, _, name in entries:
                    fh = tar.extractfile(members[name])
                    images.append(_decode_image(fh.read(), f"{folder}:{name}", mode))
        else:
            for _, _, name in entries:
                images.append(_decode_image(Path(name), name, mode))
        ref = next(i for i, e in enumerate(entries) if e[0] == "train")
        shape0 = images[ref].shape
        for img, (_, _, name) in zip(images, entries):
            if img.shape != shape0:
                where = f"{folder}:{name}" if folder.is_file() else name
                raise ConfigError(
                    f"{where}: image size {img.shape} differs from {shape0} (first train image); "
                    "expected all images the same size"
                )
        split = np.array([s == "train" for s, _, _ in entries])
        labels = np.array([cls_index[c] for _, c, _ in entries], dtype=np.int64)
        x = np.stack(images)
        xtr, ytr, xte, yte = x[split], labels[split], x[~split], labels[~split]
        save_npz_atomic(cache_file, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte,
                        classes=np.array(classes))
    if expected_classes is not None and len(classes) != expected_classes:
        raise ConfigError(
            f"{folder}: found {len(classes)} class folders ({', '.join(classes[:12])}...); expected {expected_classes}"
        )
    return _image_bundle(xtr, ytr, xte, yte, len(classes), classes)


# ----------------------------------------------------------------------------- FEMNIST (LEAF)

FEMNIST_LETTERS = tuple(range(36, 46))  # LEAF labels of lowercase 'a'..'j'


def _femnist_files(root: Path) -> tuple[list[Path], list[Path]]:
    if (root / "train").is_dir() and (root / "test").is_dir():
        tr = sorted((root / "train").glob("*.json"))
        te = sorted((root / "test").glob("*.json"))
    else:
        files = sorted(root.glob("*.json")) if root.is_dir() else []
        tr = [f for f in files if "_train_" in f.name]
        te = [f for f in files if "_test_" in f.name]
    if not tr or not te:
        raise ConfigError(
            f"data.root={str(root)!r}: no FEMNIST LEAF json found; expected train/*.json and test/*.json "
            "subfolders, or *.json files with '_train_' / '_test_' in their names"
        )
    return tr, te


def _parse_leaf_json(path: Path) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    try:
        with open(path, "rb") as fh:
            obj = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot parse json ({exc}); expected a LEAF FEMNIST json shard") from exc
    if not isinstance(obj, dict) or "users" not in obj or "user_data" not in obj:
        raise ConfigError(f"{path}: expected a json object with keys 'users' and 'user_data' (LEAF format)")
    users, xs, ys = [], [], []
    for user in obj["users"]:
        ud = obj["user_data"].get(user) if isinstance(obj["user_data"], dict) else None
        if not isinstance(ud, dict) or "x" not in ud or "y" not in ud:
            raise ConfigError(f"{path}: user_data[{user!r}] must have 'x' and 'y'")
        try:
            x = np.asarray(ud["x"], dtype=np.float32)
            y = np.asarray(ud["y"], dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: user_data[{user!r}] has non-numeric x/y ({exc})") from exc
        if x.ndim != 2 or x.shape[1] != 784 or y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ConfigError(
                f"{path}: user_data[{user!r}] has x of shape {x.shape} and y of shape {y.shape}; "
                "expected x (n, 784) and y (n,)"
            )
        if y.size and (y.min() < 0 or y.max() > 61):
            raise ConfigError(f"{path}: user_data[{user!r}] has labels outside 0..61")
        users.append(str(user))
        xs.append(x)
        ys.append(y)
    return users, xs, ys


def _read_leaf_split(files: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    users_all: list[str] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for f in files:
        users, ux, uy = _parse_leaf_json(f)
        for u, x, y in zip(users, ux, uy):
            users_all.extend([u] * len(y))
            xs.append(x)
            ys.append(y)
    x = np.concatenate(xs) if xs else np.zeros((0, 784), np.float32)
    y = np.concatenate(ys) if ys else np.zeros((0,), np.int64)
    return x, y, np.array(users_all, dtype=str)


def _load_femnist_local(root: Path, data_cfg: Mapping, cache_dir: Path) -> DataBundle:
    classes_mode = get_choice(data_cfg, "femnist_classes", "all", ("all", "digits", "letters"))
    tr_files, te_files = _femnist_files(root)
    key = _hash_key("femnist", _CACHE_VERSION, [_file_stamp(f) for f in tr_files + te_files])
    cache_file = cache_dir / "decoded" / f"femnist-{key[:32]}.npz"
    cached = load_npz(cache_file)
    if cached is not None:
        xtr, ytr, utr = cached["x_train"], cached["y_train"], cached["u_train"]
        xte, yte, ute = cached["x_test"], cached["y_test"], cached["u_test"]
    else:
        xtr, ytr, utr = _read_leaf_split(tr_files)
        xte, yte, ute = _read_leaf_split(te_files)
        save_npz_atomic(cache_file, x_train=xtr, y_train=ytr, u_train=utr, x_test=xte, y_test=yte, u_test=ute)
    return femnist_bundle(xtr.reshape(-1, 1, 28, 28), ytr, utr, xte.reshape(-1, 1, 28, 28), yte, ute,
                          classes_mode, where=str(root))


def femnist_bundle(xtr: np.ndarray, ytr: np.ndarray, utr: np.ndarray, xte: np.ndarray, yte: np.ndarray,
                   ute: np.ndarray, classes_mode: str, where: str) -> DataBundle:
    """Filter classes, keep writers present in both splits, attach writer groups."""
    if classes_mode == "digits":
        keep_labels, names = np.arange(10), [str(i) for i in range(10)]
    elif classes_mode == "letters":
        keep_labels, names = np.array(FEMNIST_LETTERS), list("abcdefghij")
    else:
        keep_labels = np.arange(62)
        names = [str(i) for i in range(10)] + [chr(ord("A") + i) for i in range(26)] + [chr(ord("a") + i) for i in range(26)]
    remap = np.full(62, -1, dtype=np.int64)
    remap[keep_labels] = np.arange(len(keep_labels))
    mtr = remap[ytr] >= 0
    mte = remap[yte] >= 0
    writers = np.intersect1d(np.unique(utr[mtr]), np.unique(ute[mte]))
    if writers.size == 0:
        raise ConfigError(f"{where}: no FEMNIST writer has both train and test samples (data.femnist_classes={classes_mode!r})")
    mtr &= np.isin(utr, writers)
    mte &= np.isin(ute, writers)
    gtr = np.searchsorted(writers, utr[mtr]).astype(np.int64)
    gte = np.searchsorted(writers, ute[mte]).astype(np.int64)
    x_train = np.ascontiguousarray(xtr[mtr], dtype=np.float32)
    x_test = np.ascontiguousarray(xte[mte], dtype=np.float32)
    bundle = _image_bundle(x_train, remap[ytr[mtr]], x_test, remap[yte[mte]], len(keep_labels), names, gtr, gte)
    bundle.meta["writers"] = [str(w) for w in writers]
    return bundle


# ----------------------------------------------------------------------------- UCI Adult

ADULT_COLUMNS = ("age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
                 "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week",
                 "native-country", "income")
ADULT_NUMERIC = ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")
ADULT_CATEGORICAL = ("workclass", "education", "marital-status", "occupation", "relationship", "race", "sex",
                     "native-country")
ADULT_PROTECTED = ("race", "sex")


def _read_adult_csv(path: Path, drop_missing: bool) -> tuple[np.ndarray, list[list[str]], np.ndarray]:
    if not path.is_file():
        raise ConfigError(f"{path}: file not found; expected the UCI Adult file in data.root")
    try:
        text = path.read_text(encoding="utf-8", errors="strict")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as text ({exc}); expected the UCI Adult CSV") from exc
    num_idx = [ADULT_COLUMNS.index(c) for c in ADULT_NUMERIC]
    cat_idx = [ADULT_COLUMNS.index(c) for c in ADULT_CATEGORICAL]
    nums: list[list[float]] = []
    cats: list[list[str]] = []
    labels: list[int] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("|"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(ADULT_COLUMNS):
            raise ConfigError(f"{path}:{lineno}: {len(fields)} fields; expected {len(ADULT_COLUMNS)} comma-separated fields")
        if drop_missing and "?" in fields:
            continue
        try:
            nums.append([float(fields[i]) for i in num_idx])
        except ValueError as exc:
            raise ConfigError(f"{path}:{lineno}: non-numeric value in a numeric column ({exc})") from exc
        cats.append([fields[i] for i in cat_idx])
        lab = fields[-1].rstrip(".")
        if lab not in (">50K", "<=50K"):
            raise ConfigError(f"{path}:{lineno}: income label {fields[-1]!r}; expected '>50K' or '<=50K' (optionally ending in '.')")
        labels.append(1 if lab == ">50K" else 0)
    if not labels:
        raise ConfigError(f"{path}: no data rows; expected the UCI Adult CSV")
    return np.asarray(nums, dtype=np.float64), cats, np.asarray(labels, dtype=np.int64)


def _load_adult(root: Path, data_cfg: Mapping, normalize: bool) -> DataBundle:
    missing = get_choice(data_cfg, "adult_missing", "keep", ("keep", "drop"))
    include_protected = get_bool(data_cfg, "adult_include_protected", True)
    base = root if root.is_dir() else root.parent
    ntr, ctr, ytr = _read_adult_csv(base / "adult.data", missing == "drop")
    nte, cte, yte = _read_adult_csv(base / "adult.test", missing == "drop")
    mean = ntr.mean(axis=0)
    std = ntr.std(axis=0)
    std[std < 1e-12] = 1.0
    if normalize:
        ntr = (ntr - mean) / std
        nte = (nte - mean) / std
    feat_tr = [ntr]
    feat_te = [nte]
    feature_names = list(ADULT_NUMERIC)
    attr_cats: dict[str, list[str]] = {}
    attrs_tr: dict[str, np.ndarray] = {}
    attrs_te: dict[str, np.ndarray] = {}
    for j, col in enumerate(ADULT_CATEGORICAL):
        vtr = np.array([row[j] for row in ctr])
        vte = np.array([row[j] for row in cte])
        cats = np.unique(vtr)
        code_tr = np.searchsorted(cats, vtr)
        code_te = np.searchsorted(cats, vte)
        code_te[(code_te >= len(cats)) | (cats[np.minimum(code_te, len(cats) - 1)] != vte)] = -1
        if col in ADULT_PROTECTED:
            attr_cats[col] = [str(c) for c in cats]
            attrs_tr[col] = code_tr.astype(np.int64)
            attrs_te[col] = code_te.astype(np.int64)
            if not include_protected:
                continue
        eye = np.eye(len(cats), dtype=np.float64)
        feat_tr.append(eye[code_tr])
        oh_te = np.zeros((len(vte), len(cats)))
        ok = code_te >= 0
        oh_te[ok] = eye[code_te[ok]]
        feat_te.append(oh_te)
        feature_names.extend(f"{col}={c}" for c in cats)
    xtr = np.concatenate(feat_tr, axis=1).astype(np.float32)
    xte = np.concatenate(feat_te, axis=1).astype(np.float32)
    meta = {
        "class_names": ["<=50K", ">50K"],
        "feature_names": feature_names,
        "attribute_categories": attr_cats,
        "numeric_mean": mean.astype(np.float32),
        "numeric_std": std.astype(np.float32),
    }
    return DataBundle(
        train=ArrayData(xtr, ytr, None, attrs_tr),
        test=ArrayData(xte, yte, None, attrs_te),
        num_classes=2,
        input_shape=(xtr.shape[1],),
        meta=meta,
    )


# ----------------------------------------------------------------------------- Hugging Face Hub

_HUB_LABEL_COLUMNS = {"cifar100": "fine_label", "femnist": "character"}


def _hub_split_arrays(ds: Any, name: str, mode: str, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    from PIL import Image

    cols = list(ds.column_names)
    img_col = next((c for c in ("image", "img") if c in cols), None)
    label_col = _HUB_LABEL_COLUMNS.get(name, "label")
    if img_col is None or label_col not in cols:
        raise ConfigError(f"{where}: columns {cols}; expected an image column ('image' or 'img') and {label_col!r}")
    images = []
    for im in ds[img_col]:
        if not isinstance(im, Image.Image):
            im = Image.fromarray(np.asarray(im, dtype=np.uint8))
        if name == "femnist" and im.size != (28, 28):
            im = im.resize((28, 28))
        images.append(np.asarray(im.convert(mode), dtype=np.uint8))
    x = np.stack(images) if images else np.zeros((0, 1, 1), np.uint8)
    y = np.asarray(ds[label_col], dtype=np.int64)
    writers = np.asarray(ds["writer_id"], dtype=str) if name == "femnist" and "writer_id" in cols else None
    return x, y, writers


def _hub_split_or_none(fds, split: str):
    """The whole ``split`` of a flwr-datasets FederatedDataset, or None when it has no such split."""
    try:
        return fds.load_split(split)
    except ValueError as exc:
        if "not present" in str(exc):
            return None
        raise


def _load_hub(name: str, data_cfg: Mapping, cache_dir: Path, normalize: bool) -> DataBundle:
    hub_id = cfg_get(data_cfg, "hub_id", HUB_DEFAULTS[name])
    if not isinstance(hub_id, str) or not hub_id:
        raise ConfigError(f"data.hub_id={hub_id!r} is invalid: expected a Hugging Face dataset id like {HUB_DEFAULTS[name]!r}")
    where = f"data.hub_id={hub_id!r}"
    try:
        from flwr_datasets import FederatedDataset

        fds = FederatedDataset(dataset=hub_id, partitioners={}, shuffle=False, cache_dir=str(cache_dir / "hub"))
        dd = {split: ds for split in ("train", "test") if (ds := _hub_split_or_none(fds, split)) is not None}
    except Exception as exc:  # noqa: BLE001 - network, auth, missing dataset, ...
        raise ConfigError(
            f"data.source='hub': could not load {where} from the Hugging Face Hub "
            f"({type(exc).__name__}: {exc}); check the id and network access, or use data.source=local with data.root"
        ) from exc
    mode = "RGB" if name in ("cifar10", "cifar100") else "L"
    splits = list(dd.keys())

    def split_arrays(split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        ds = dd[split]
        fingerprint = getattr(ds, "_fingerprint", None)
        cache_file = None
        if fingerprint:
            key = _hash_key("hub", _CACHE_VERSION, hub_id, split, mode, fingerprint)
            cache_file = cache_dir / "decoded" / f"hub-{key[:32]}.npz"
            cached = load_npz(cache_file)
            if cached is not None:
                return cached["x"], cached["y"], cached.get("writers")
        x, y, writers = _hub_split_arrays(ds, name, mode, where)
        if cache_file is not None:
            extra = {} if writers is None else {"writers": writers}
            save_npz_atomic(cache_file, x=x, y=y, **extra)
        return x, y, writers
    if name == "femnist":
        classes_mode = get_choice(data_cfg, "femnist_classes", "all", ("all", "digits", "letters"))
        test_fraction = get_float(data_cfg, "femnist_test_fraction", 0.1, gt=0.0, lt=1.0)
        split_seed = get_int(data_cfg, "split_seed", 0, lo=0)
        if "train" not in splits:
            raise ConfigError(f"{where}: splits {splits}; expected a 'train' split")
        x, y, writers = split_arrays("train")
        if writers is None:
            raise ConfigError(f"{where}: no 'writer_id' column; expected FEMNIST with writer ids")
        is_test = np.zeros(len(y), dtype=bool)
        rng = np.random.default_rng(split_seed)
        order = np.argsort(writers, kind="stable")
        bounds = np.flatnonzero(np.r_[True, writers[order][1:] != writers[order][:-1], True])
        for a, b in zip(bounds[:-1], bounds[1:]):
            members = order[a:b]
            n_test = int(round(test_fraction * len(members)))
            if len(members) >= 2:
                n_test = min(max(n_test, 1), len(members) - 1)
                is_test[rng.permutation(members)[:n_test]] = True
        xf = images_to_float(x)
        bundle = femnist_bundle(xf[~is_test], y[~is_test], writers[~is_test], xf[is_test], y[is_test],
                                writers[is_test], classes_mode, where)
    else:
        test_split = "test" if "test" in splits else None
        if "train" not in splits or test_split is None:
            raise ConfigError(f"{where}: splits {splits}; expected 'train' and 'test'")
        xtr, ytr, _ = split_arrays("train")
        xte, yte, _ = split_arrays(test_split)
        ncls = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100}[name]
        names = None
        try:
            names = list(dd["train"].features[_HUB_LABEL_COLUMNS.get(name, "label")].names)
        except Exception:  # noqa: BLE001 - label feature without names
            names = None
        for split_name, y in (("train", ytr), (test_split, yte)):
            if y.size and (y.min() < 0 or y.max() >= ncls):
                raise ConfigError(f"{where}: split {split_name!r} has labels outside 0..{ncls - 1}")
        bundle = _image_bundle(xtr, ytr, xte, yte, ncls, names)
    if normalize:
        normalize_images(bundle)
    return bundle


__all__ = [
    "ArrayData",
    "DataBundle",
    "DATASET_NAMES",
    "HUB_DEFAULTS",
    "load_source",
    "normalize_images",
    "read_idx",
]
