"""Per-node datasets: each SuperNode reads its own files from its node config ``data-path``.

In a deployment every SuperNode holds its own data in a directory named by the node config
key ``data-path``, in the local format of ``data.name``: :func:`load_node_data` reads it with
the reader that reads ``data.root`` (:func:`task.data.sources.load_source`, always
``data.source=local``) and :func:`check_node_data` checks it against the model.
:func:`write_partitions` produces such directories from a global copy: client ``i`` of the
simulation's partition (same ``data`` config and seed, hence the same sample indices) is
written to ``out/node-{i}/`` from an un-normalised load (``data.normalize=false``) of the same
source, so images are written back as the exact uint8 pixels they were decoded from.

Layout written by :func:`write_node_data` for each ``data.name``:

``mnist``, ``fashion_mnist``
    The four gzip IDX files of :mod:`task.data.datasets.idx` directly in the directory:
    ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``.
``cifar10``, ``cifar100``
    The python pickles of :mod:`task.data.datasets.cifar`: ``cifar-10-batches-py/data_batch_1`` ..
    ``data_batch_5`` (the train split cut into five consecutive batches) and ``test_batch``,
    or ``cifar-100-python/train`` and ``test``; each a dict with bytes keys ``b"data"``
    (uint8 (N, 3072), channel-major rows) and ``b"labels"`` / ``b"fine_labels"``. Written
    from any cifar source, including an image-folder (JPEG) global copy.
``image_folder``
    PNG files ``train/<class>/<n>.png`` and ``test/<class>/<n>.png`` (:mod:`task.data.datasets.image_folder`;
    ``n`` is the sample's position in its split, 6 digits), grey (``L``) for 1-channel and
    ``RGB`` for 3-channel images. Class folders are named by ``meta["class_names"]`` (the
    reader numbers classes by sorted folder name), or by zero-padded label numbers.
``femnist``
    LEAF json shards ``train/data.json`` and ``test/data.json`` (:mod:`task.data.datasets.femnist`):
    one LEAF user per writer id (``meta["writers"][group]``), ``x`` the 784 floats as stored
    (exact), ``y`` the LEAF label (0-61, mapped back from ``meta["class_names"]``, so any
    ``data.femnist_classes`` mode reads back the same labels).
``adult``
    UCI CSV files ``adult.data`` (train) and ``adult.test`` (:mod:`task.data.datasets.adult`),
    their rows rebuilt from an un-normalised ``data.adult_split=uci`` load: the numeric
    columns as stored, categories decoded from the one-hot columns (``race`` / ``sex`` from
    ``ArrayData.attributes``), income from the label. These are the original file's fields
    for every row whose categories occur in the global train file (for the UCI files the
    original lines byte for byte, less ``adult.test``'s header line and the ``.`` after its
    labels); a row with an unseen category (encoded as all zeros) cannot be restored and is
    refused, and so is a ``data.adult_split=fairness`` load (no ``fnlwgt``, and that reader
    re-splits ``adult.data`` by itself).

Limits of the readers, which derive some facts from the node's own files: the image-folder
reader numbers only the classes that have train images, so a node missing a class gets other
label numbers; the adult reader takes each column's categories from the node's own
``adult.data``, so a node's one-hot width can differ from the global one; standardisation
(``data.normalize``) uses the node's own train statistics. :func:`check_node_data` reports
the resulting class-count and input-shape mismatches.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import string
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from task.data.datasets.adult import ADULT_CATEGORICAL, ADULT_COLUMNS, ADULT_NUMERIC, ADULT_PROTECTED
from task.data.datasets.bundle import ArrayData, DataBundle
from task.data.datasets.config import cfg_get, to_plain
from task.data.datasets.idx import _IDX_FILES
from task.errors import ConfigError
from task.data.federated_data import build_federated_data
from task.data.sources import load_source

#: The LEAF FEMNIST class of each label 0-61, as named in ``bundle.meta["class_names"]``.
_LEAF_CLASSES = string.digits + string.ascii_uppercase + string.ascii_lowercase
#: (sub-directory, train batch files, test file, label key) of the CIFAR python pickles.
_CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels"),
    "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels"),
}


def _where(path: str | os.PathLike) -> str:
    return f"node config data-path={os.fspath(path)!r}"


def load_node_data(data_cfg: Mapping, path: str | os.PathLike) -> DataBundle:
    """This node's dataset from ``path`` (node config ``data-path``), read as ``data.name``."""
    path = Path(os.path.expanduser(os.fspath(path)))
    name = _file_based(cfg_get(data_cfg, "name"), _where(path))
    if not path.exists():
        raise ConfigError(f"{_where(path)} does not exist: expected the node's own {name} files")
    node_cfg = {**to_plain(data_cfg), "root": str(path), "source": "local"}
    try:
        return load_source(node_cfg)
    except ConfigError as exc:
        raise ConfigError(f"{_where(path)}: {exc}") from exc


def check_node_data(bundle: DataBundle, input_shape: tuple[int, ...], num_classes: int,
                    path: str | os.PathLike) -> None:
    """Raise ConfigError (naming ``data-path``) unless ``bundle`` fits the model's inputs and classes."""
    for split in ("train", "test"):
        if len(getattr(bundle, split)) == 0:
            raise ConfigError(f"{_where(path)}: the {split} split is empty; expected at least one {split} sample")
    if tuple(bundle.input_shape) != tuple(input_shape):
        raise ConfigError(
            f"{_where(path)}: inputs have shape {tuple(bundle.input_shape)}; expected {tuple(input_shape)} "
            "(the model's input shape)"
        )
    if bundle.num_classes != num_classes:
        raise ConfigError(f"{_where(path)}: the data has {bundle.num_classes} classes; expected {num_classes}")
    for split in ("train", "test"):
        y = getattr(bundle, split).y
        bad = np.unique(y[(y < 0) | (y >= num_classes)])
        if bad.size:
            raise ConfigError(
                f"{_where(path)}: {split} labels {bad[:5].tolist()} are outside [0, {num_classes})"
            )


def write_node_data(name: str, out: str | os.PathLike, train: ArrayData, test: ArrayData,
                    meta: dict[str, Any] | None = None) -> Path:
    """Write un-normalised ``train`` / ``test`` to the new or empty directory ``out`` in the
    local format of ``name`` (layouts in the module docstring); ``meta`` is the source
    bundle's meta. Returns ``out``."""
    writer = _WRITERS[_file_based(name, "write_node_data")]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ConfigError(f"{out}: directory is not empty; expected a new or empty directory for the node data")
    writer(name, out, train, test, meta or {})
    return out


def write_partitions(data_cfg: Mapping, seed: int, out: str | os.PathLike) -> list[Path]:
    """Write client ``i`` of the simulation's partition of ``data_cfg`` / ``seed`` to
    ``out/node-{i}``; returns those directories. Indices and samples come from the
    ``normalize=false`` twin of ``build_federated_data(data_cfg, seed)`` (normalisation
    changes neither the partition nor the sample order)."""
    name = _file_based(cfg_get(data_cfg, "name"), "write_partitions")
    fed = build_federated_data({**to_plain(data_cfg), "normalize": False}, seed)  # partitions follow the labels only
    raw = fed.bundle
    return [
        write_node_data(name, Path(out) / f"node-{i}", _take(raw.train, tr), _take(raw.test, te), raw.meta)
        for i, (tr, te) in enumerate(zip(fed.client_train, fed.client_test))
    ]


def _file_based(name: Any, where: str) -> str:
    if name not in _WRITERS:
        raise ConfigError(
            f"{where}: per-node data needs a file-based data.name ({', '.join(_WRITERS)}); got data.name={name!r}"
        )
    return name


def _take(data: ArrayData, idx: np.ndarray) -> ArrayData:
    """The samples ``idx`` of one split."""
    group = None if data.group is None else data.group[idx]
    attributes = None if data.attributes is None else {k: v[idx] for k, v in data.attributes.items()}
    return ArrayData(data.x[idx], data.y[idx], group, attributes)


def _raw_images(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` unchanged after checking it holds un-normalised images in [0, 1]."""
    if x.size and (x.min() < 0 or x.max() > 1):
        raise ConfigError(
            f"{name} node data: image values span [{x.min():.3g}, {x.max():.3g}]; expected un-normalised "
            "images in [0, 1] (load the source with data.normalize=false)"
        )
    return x


def _to_uint8(x: np.ndarray, name: str) -> np.ndarray:
    """(N, C, H, W) floats in [0, 1] -> uint8 (the exact inverse of ``images_to_float``)."""
    return np.rint(_raw_images(x, name) * 255).astype(np.uint8)


def _write_idx_file(path: Path, arr: np.ndarray) -> None:
    header = struct.pack(">" + "I" * (arr.ndim + 1), 0x800 + arr.ndim, *arr.shape)
    with gzip.open(path, "wb", compresslevel=6) as fh:  # as small as level 9 here, ~10x faster
        fh.write(header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes())


def _write_idx(name: str, out: Path, train: ArrayData, test: ArrayData, meta: dict[str, Any]) -> None:
    for prefix, data in (("train", train), ("test", test)):
        images = _to_uint8(data.x, name)
        if images.shape[1] != 1:
            raise ConfigError(f"{name} node data: images have {images.shape[1]} channels; expected 1")
        _write_idx_file(out / f"{_IDX_FILES[f'{prefix}_images'][0]}.gz", images[:, 0])
        _write_idx_file(out / f"{_IDX_FILES[f'{prefix}_labels'][0]}.gz", data.y.astype(np.uint8))


def _write_cifar(name: str, out: Path, train: ArrayData, test: ArrayData, meta: dict[str, Any]) -> None:
    sub, train_files, test_file, label_key = _CIFAR_FILES[name]
    folder = out / sub
    folder.mkdir()
    batches = np.array_split(np.arange(len(train)), len(train_files))
    for fname, data in [*zip(train_files, (_take(train, b) for b in batches)), (test_file, test)]:
        rows = _to_uint8(data.x, name).reshape(len(data), -1)
        with open(folder / fname, "wb") as fh:
            pickle.dump({b"data": rows, label_key: data.y.tolist()}, fh)


def _numbered_classes(train: ArrayData, test: ArrayData) -> list[str]:
    """Zero-padded label numbers, which sort in label order."""
    num_classes = int(max(train.y.max(initial=0), test.y.max(initial=0))) + 1
    return [f"{i:0{len(str(num_classes - 1))}d}" for i in range(num_classes)]


def _write_image_folder(name: str, out: Path, train: ArrayData, test: ArrayData, meta: dict[str, Any]) -> None:
    from PIL import Image

    classes = meta.get("class_names") or _numbered_classes(train, test)
    if list(classes) != sorted(classes):
        raise ConfigError(
            f"image_folder node data: class names {list(classes)[:12]} are not sorted; the reader numbers "
            "classes by sorted folder name"
        )
    for split, data in (("train", train), ("test", test)):
        for n, (img, label) in enumerate(zip(_to_uint8(data.x, name), data.y)):
            folder = out / split / classes[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(folder / f"{n:06d}.png")


def _leaf_shard(data: ArrayData, users: np.ndarray, leaf_labels: np.ndarray) -> dict[str, Any]:
    """A LEAF json object: users in order of first appearance, each with its samples in order."""
    x = _raw_images(data.x, "femnist").reshape(len(data), -1).astype(np.float64)
    y = leaf_labels[data.y]
    order = list(dict.fromkeys(users.tolist()))
    user_data = {u: {"x": x[users == u].tolist(), "y": y[users == u].tolist()} for u in order}
    return {"users": order, "num_samples": [len(user_data[u]["y"]) for u in order], "user_data": user_data}


def _write_femnist(name: str, out: Path, train: ArrayData, test: ArrayData, meta: dict[str, Any]) -> None:
    leaf_labels = np.array([_LEAF_CLASSES.index(c) for c in meta.get("class_names", _LEAF_CLASSES)])
    writers = meta.get("writers")
    users = {}
    for split, data in (("train", train), ("test", test)):
        if data.group is None:
            raise ConfigError(f"femnist node data: the {split} split has no writer ids (ArrayData.group)")
        users[split] = np.array([writers[g] for g in data.group] if writers else data.group.astype(str), dtype=str)
    one_split = sorted(set(users["train"].tolist()) ^ set(users["test"].tolist()))
    if one_split:
        raise ConfigError(
            f"femnist node data: writers {one_split[:5]} have samples in only one of train/test, and the "
            "femnist reader keeps only writers with both; use data.partition=natural"
        )
    for split, data in (("train", train), ("test", test)):
        (out / split).mkdir()
        with open(out / split / "data.json", "w") as fh:
            json.dump(_leaf_shard(data, users[split], leaf_labels), fh)


def _adult_fields(data: ArrayData, meta: dict[str, Any], fname: str) -> dict[str, list[str]]:
    """The UCI field strings of each column for the rows of ``data``."""
    names = list(meta["feature_names"])
    fields = {"income": [">50K" if v == 1 else "<=50K" for v in data.y]}
    for col in ADULT_NUMERIC:
        fields[col] = [np.format_float_positional(v, trim="-") for v in data.x[:, names.index(col)]]
    for col in ADULT_CATEGORICAL:
        if col in ADULT_PROTECTED:
            categories, codes = meta["attribute_categories"][col], data.attributes[col]
        else:
            columns = [j for j, n in enumerate(names) if n.startswith(f"{col}=")]
            categories = [names[j].split("=", 1)[1] for j in columns]
            onehot = data.x[:, columns]
            codes = np.where(onehot.sum(axis=1) == 1, onehot.argmax(axis=1), -1)
        if (codes < 0).any():
            raise ConfigError(
                f"adult node data ({fname}): {int((codes < 0).sum())} rows have a {col} category not seen in "
                "the global adult.data; the one-hot encoding cannot restore it"
            )
        fields[col] = [categories[c] for c in codes]
    return fields


def _write_adult(name: str, out: Path, train: ArrayData, test: ArrayData, meta: dict[str, Any]) -> None:
    if "fnlwgt" not in meta.get("feature_names", ()):
        raise ConfigError(
            "adult node data is written from a data.adult_split=uci load (with the bundle's meta): the "
            "fairness split drops fnlwgt and re-splits adult.data by itself"
        )
    for fname, data in (("adult.data", train), ("adult.test", test)):
        fields = _adult_fields(data, meta, fname)
        rows = zip(*(fields[col] for col in ADULT_COLUMNS))
        (out / fname).write_text("".join(", ".join(row) + "\n" for row in rows))


_WRITERS: dict[str, Callable[[str, Path, ArrayData, ArrayData, dict[str, Any]], None]] = {
    "mnist": _write_idx,
    "fashion_mnist": _write_idx,
    "cifar10": _write_cifar,
    "cifar100": _write_cifar,
    "image_folder": _write_image_folder,
    "femnist": _write_femnist,
    "adult": _write_adult,
}

__all__ = ["check_node_data", "load_node_data", "write_node_data", "write_partitions"]
