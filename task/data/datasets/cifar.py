"""CIFAR-10 / CIFAR-100 from the python pickles, else from an image folder.

``data.root`` layout: the python pickles ``cifar-10-batches-py/`` (``data_batch_1..5``,
``test_batch``) / ``cifar-100-python/`` (``train``, ``test``; fine labels), under
``root`` or ``root`` itself; otherwise an image-folder layout (see
:mod:`task.data.datasets.image_folder`) with 10 / 100 classes, e.g. the JPEG re-encoding
``CIFAR-10-images-jpeg.tar``.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from task.data.datasets.bundle import DataBundle
from task.data.datasets.image_folder import find_image_folder, load_image_folder
from task.data.datasets.images import image_bundle
from task.errors import ConfigError

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


def _layout(name: str) -> tuple[str, list[str], list[str], bytes, int]:
    if name == "cifar10":
        return "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels", 10
    return "cifar-100-python", ["train"], ["test"], b"fine_labels", 100


def load_cifar_arrays(name: str, root: Path) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None:
    """(train, test) uint8 HWC images and labels from the python pickles under ``root`` (or
    ``root`` itself); None when they are not there."""
    sub, train_files, test_files, key, ncls = _layout(name)
    for d in (root / sub, root):
        if d.is_dir() and all((d / f).is_file() for f in train_files + test_files):
            parts_tr = [_unpickle(d / f, key) for f in train_files]
            parts_te = [_unpickle(d / f, key) for f in test_files]
            for f, (_, y) in zip(train_files + test_files, parts_tr + parts_te):
                bad = np.flatnonzero((y < 0) | (y >= ncls))
                if bad.size:
                    raise ConfigError(f"{d / f}: label {int(y[bad[0]])} at index {int(bad[0])} is outside "
                                      f"0..{ncls - 1} ({bad.size} such labels)")
            return ((np.concatenate([p[0] for p in parts_tr]), np.concatenate([p[1] for p in parts_tr])),
                    (np.concatenate([p[0] for p in parts_te]), np.concatenate([p[1] for p in parts_te])))
    return None


def load_cifar(name: str, root: Path, data_cfg: Mapping, cache_dir: Path) -> DataBundle:
    """CIFAR-10 or CIFAR-100 (``name``) from the pickles under ``root``, else from an image folder."""
    sub, train_files, test_files, _, ncls = _layout(name)
    arrays = load_cifar_arrays(name, root)
    if arrays is not None:
        (xtr, ytr), (xte, yte) = arrays
        names = list(CIFAR10_CLASSES) if name == "cifar10" else None
        return image_bundle(xtr, ytr, xte, yte, ncls, names)
    try:
        folder = find_image_folder(root)
    except ConfigError as exc:
        raise ConfigError(
            f"data.root={str(root)!r}: no {name} data found; expected {sub}/ with "
            f"{', '.join(train_files + test_files)} (under data.root or data.root itself) "
            f"or an image-folder layout (train/<class>/*.jpg, test/<class>/*.jpg, as a directory "
            f"or .tar). ({exc})"
        ) from None
    return load_image_folder(folder, data_cfg, cache_dir, expected_classes=ncls, channels=3)
