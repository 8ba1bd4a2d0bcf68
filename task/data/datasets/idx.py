"""MNIST / Fashion-MNIST from IDX files.

``data.root`` layout: the four IDX files ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``
(each gzip-compressed ``.gz`` or plain) directly in ``root`` or in
``root/MNIST/raw`` (``root/FashionMNIST/raw``).
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from task.data.datasets.bundle import DataBundle
from task.data.datasets.images import image_bundle
from task.errors import ConfigError

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


def load_idx(name: str, root: Path) -> DataBundle:
    """MNIST or Fashion-MNIST (``name``) from the IDX files under ``root``."""
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
    return image_bundle(arrays["train_images"], arrays["train_labels"], arrays["test_images"],
                        arrays["test_labels"], 10, names)
