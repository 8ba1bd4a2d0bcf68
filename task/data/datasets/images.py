"""Image arrays: uint8 to float conversion, train-statistics normalisation, bundling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from task.data.datasets.bundle import ArrayData, DataBundle


class ImageArray:
    """uint8 images (N, C, H, W) that read as float32: ``x / 255``, then ``(x - mean) / std`` per
    channel once :func:`normalize_images` set the train statistics.

    A quarter of the memory of the float32 array; indexing (``a[idx]``) converts only the
    selected images, with the same float32 operations in the same order as converting the whole
    array, so every value is bit-identical to the eager conversion. ``np.asarray(a)`` converts
    everything. ``raw`` is the uint8 array (never modified).
    """

    dtype = np.dtype(np.float32)

    def __init__(self, raw: np.ndarray, mean: np.ndarray | None = None, std: np.ndarray | None = None) -> None:
        if raw.dtype != np.uint8 or raw.ndim != 4:
            raise ValueError(f"ImageArray needs uint8 (N, C, H, W) images, got {raw.dtype} {raw.shape}")
        self.raw = raw
        self.mean = mean
        self.std = std

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw.shape

    @property
    def ndim(self) -> int:
        return 4

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, idx) -> np.ndarray:
        return self.convert(self.raw[idx])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.convert(self.raw)
        return out if dtype is None else out.astype(dtype)

    def convert(self, raw: np.ndarray) -> np.ndarray:
        """``raw`` uint8 images of this array as its float32 values."""
        out = np.empty(raw.shape, dtype=np.float32)
        np.multiply(raw, np.float32(1.0 / 255.0), out=out, casting="unsafe")
        if self.mean is not None:  # (C, 1, 1) broadcasts over one image or a batch
            out -= self.mean.reshape(-1, 1, 1)
            out /= self.std.reshape(-1, 1, 1)
        return out

    def channel_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and standard deviation (float64) of the un-normalised float values,
        exactly, from the histogram of the 256 pixel values."""
        values = np.multiply(np.arange(256, dtype=np.uint8), np.float32(1.0 / 255.0), dtype=np.float32)
        values = values.astype(np.float64)
        counts = np.zeros((self.shape[1], 256), dtype=np.int64)
        for start in range(0, len(self.raw), 4096):  # bincount widens to int64: chunks bound that copy
            block = self.raw[start:start + 4096]
            for c in range(self.shape[1]):
                counts[c] += np.bincount(block[:, c].reshape(-1), minlength=256)
        n = counts.sum(axis=1)
        mean = counts @ values / n
        var = (counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / n
        return mean, np.sqrt(var)


def images_to_float(x_uint8: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) uint8 -> float32 (N, C, H, W) in [0, 1]."""
    return np.asarray(ImageArray(channels_first(x_uint8)))


def channels_first(x_uint8: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) uint8 -> (N, C, H, W) uint8, a view: colour images keep their
    channels-last memory (no copy; the layout convolutions prefer anyway)."""
    if x_uint8.ndim == 3:
        return x_uint8[:, None, :, :]
    return np.transpose(x_uint8, (0, 3, 1, 2))


def normalize_images(bundle: DataBundle) -> None:
    """In place: standardise (N, C, H, W) images with per-channel train mean/std."""
    xtr = bundle.train.x
    if xtr.ndim != 4:
        return
    if isinstance(xtr, ImageArray):
        mean, std = xtr.channel_stats()
    else:
        mean = xtr.mean(axis=(0, 2, 3), dtype=np.float64)
        var = np.zeros_like(mean)
        for c in range(xtr.shape[1]):
            var[c] = np.mean((xtr[:, c].astype(np.float64) - mean[c]) ** 2)
        std = np.sqrt(var)
    std[std < 1e-12] = 1.0
    m = mean.astype(np.float32)
    s = std.astype(np.float32)
    for arr in (bundle.train.x, bundle.test.x):
        if isinstance(arr, ImageArray):
            arr.mean, arr.std = m, s
        else:
            arr -= m[None, :, None, None]
            arr /= s[None, :, None, None]
    bundle.meta["mean"] = m
    bundle.meta["std"] = s


def image_bundle(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                 num_classes: int, class_names: Sequence[str] | None = None,
                 g_train: np.ndarray | None = None, g_test: np.ndarray | None = None) -> DataBundle:
    """Bundle image splits: uint8 (N, H, W[, C]) arrays are kept as uint8 :class:`ImageArray` s
    (converted to float32 on access), float32 (N, C, H, W) arrays as they are."""
    xtr = x_train if x_train.dtype == np.float32 and x_train.ndim == 4 else ImageArray(channels_first(x_train))
    xte = x_test if x_test.dtype == np.float32 and x_test.ndim == 4 else ImageArray(channels_first(x_test))
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
