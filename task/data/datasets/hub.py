"""Datasets from the Hugging Face Hub, as whole splits through flwr-datasets.

Config keys (under ``data.``)
-----------------------------
``hub_id``
    Optional Hub dataset id; defaults (:data:`HUB_DEFAULTS`): mnist ``ylecun/mnist``,
    fashion_mnist ``zalando-datasets/fashion_mnist``, cifar10 ``uoft-cs/cifar10``, cifar100
    ``uoft-cs/cifar100``, femnist ``flwrlabs/femnist``.
``split_seed``
    Int, default 0: seed of the per-writer split of Hub FEMNIST (which has a single split).
``femnist_test_fraction``
    Float in (0, 1), default 0.1: per-writer test fraction for Hub FEMNIST only (the
    Hub copy has no test split; LEAF uses 0.9/0.1 per writer).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from task.data.datasets.bundle import DataBundle
from task.data.datasets.cache import CACHE_VERSION, hash_key, load_npz, save_npz_atomic
from task.data.datasets.config import cfg_get, get_choice, get_float, get_int
from task.data.datasets.femnist import FEMNIST_CLASS_MODES, femnist_bundle
from task.data.datasets.images import image_bundle, images_to_float, normalize_images
from task.errors import ConfigError

HUB_DEFAULTS: dict[str, str] = {
    "mnist": "ylecun/mnist",
    "fashion_mnist": "zalando-datasets/fashion_mnist",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "femnist": "flwrlabs/femnist",
}

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


def _local_alternative(name: str) -> str:
    """How to read ``name`` from local files instead (the data home, or data.root)."""
    from task.data.home import DEFAULT_FOLDERS, HOME_FOLDERS

    entry = HOME_FOLDERS.get(DEFAULT_FOLDERS.get(name, ""))
    fetch = f" after `flrep data fetch {entry.folder}`" if entry is not None and entry.fetchable else ""
    return f"data.source=local (the data home's folder{fetch}, or data.root)"


def _hub_split_or_none(fds, split: str):
    """The whole ``split`` of a flwr-datasets FederatedDataset, or None when it has no such split."""
    try:
        return fds.load_split(split)
    except ValueError as exc:
        if "not present" in str(exc):
            return None
        raise


def load_hub(name: str, data_cfg: Mapping, cache_dir: Path, normalize: bool) -> DataBundle:
    """Dataset ``name`` from the Hugging Face Hub (``data.hub_id``), decoded splits cached as ``.npz``."""
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
            f"({type(exc).__name__}: {exc}); check the id and network access, or use {_local_alternative(name)}"
        ) from exc
    mode = "RGB" if name in ("cifar10", "cifar100") else "L"
    splits = list(dd.keys())

    def split_arrays(split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        ds = dd[split]
        fingerprint = getattr(ds, "_fingerprint", None)
        cache_file = None
        if fingerprint:
            key = hash_key("hub", CACHE_VERSION, hub_id, split, mode, fingerprint)
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
        classes_mode = get_choice(data_cfg, "femnist_classes", "all", FEMNIST_CLASS_MODES)
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
        bundle = image_bundle(xtr, ytr, xte, yte, ncls, names)
    if normalize:
        normalize_images(bundle)
    return bundle
