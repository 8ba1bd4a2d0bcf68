"""scikit-learn's 8x8 digits with a stratified train/test split (no files needed).

Config keys (under ``data.``)
-----------------------------
``split_seed``
    Int, default 0: seed of the digits stratified train/test split.
``test_fraction``
    Float in (0, 1), default 0.25: digits test fraction.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from task.data.datasets.bundle import DataBundle
from task.data.datasets.config import get_float, get_int
from task.data.datasets.images import image_bundle, normalize_images


def load_digits(data_cfg: Mapping, normalize: bool) -> DataBundle:
    """The digits bundle, split per ``data.test_fraction`` / ``data.split_seed``."""
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    test_fraction = get_float(data_cfg, "test_fraction", 0.25, gt=0.0, lt=1.0)
    split_seed = get_int(data_cfg, "split_seed", 0, lo=0)
    digits = sklearn_load_digits()
    x = (digits.images.astype(np.float32) / np.float32(16.0))[:, None, :, :]
    y = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=test_fraction, random_state=split_seed, stratify=y
    )
    idx_train.sort()
    idx_test.sort()
    bundle = image_bundle(x[idx_train], y[idx_train], x[idx_test], y[idx_test], 10,
                          [str(i) for i in range(10)])
    if normalize:
        normalize_images(bundle)
    return bundle
