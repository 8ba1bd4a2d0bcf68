"""Image arrays: uint8 to float conversion, train-statistics normalisation, bundling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from task.data.datasets.bundle import ArrayData, DataBundle


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


def image_bundle(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                 num_classes: int, class_names: Sequence[str] | None = None,
                 g_train: np.ndarray | None = None, g_test: np.ndarray | None = None) -> DataBundle:
    """Bundle image splits, converting uint8 (N, H, W[, C]) arrays to float (N, C, H, W)."""
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
