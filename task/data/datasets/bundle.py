"""The in-memory dataset containers: :class:`ArrayData` (one split) and :class:`DataBundle`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
