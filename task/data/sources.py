"""Dataset sources: load a whole dataset (train + test) into numpy arrays.

``load_source(data_cfg)`` turns the ``data:`` section of the run config into a
:class:`DataBundle`. No Flower import here; partitioning lives in :mod:`task.data.partition`.
Each source is read by its own module of :mod:`task.data.datasets`, whose docstring documents
its file layout and its own config keys; this module dispatches by name and re-exports
the names the rest of the code imports.

Config keys (all under ``data.``)
---------------------------------
``name``
    One of :data:`DATASET_NAMES`: ``digits``, ``mnist``, ``fashion_mnist``, ``cifar10``,
    ``cifar100``, ``femnist``, ``adult``, ``image_folder``, ``synthetic_linear``,
    ``synthetic_quadratic`` (:mod:`task.data.synthetic_quadratic`). Required.
``source``
    ``local`` (default) or ``hub``. ``hub`` loads ``data.hub_id`` with
    flwr-datasets' ``FederatedDataset`` (whole splits, our own partitioning) and needs network
    access on first use; it is available for mnist, fashion_mnist, cifar10, cifar100 and
    femnist. ``digits`` and ``synthetic_linear`` ignore it (they need no files).
    Hub keys: :mod:`task.data.datasets.hub`.
``root``
    Directory (or, for image-folder layouts, a ``.tar`` file) holding the local files. Null
    means the dataset's folder in the data home, a relative path a path inside it
    (:mod:`task.data.home`); required for image_folder; ignored for digits and synthetic_linear. Accepted layouts:
    :mod:`task.data.datasets.idx` (mnist / fashion_mnist), :mod:`task.data.datasets.cifar`,
    :mod:`task.data.datasets.image_folder`, :mod:`task.data.datasets.femnist`,
    :mod:`task.data.datasets.adult`.
``cache_dir``
    Directory for decoded-array caches, Hub downloads and partition caches. Default
    ``~/.cache/flrep``. If it cannot be written, caching is skipped (with a warning).
``normalize``
    Bool, default ``true``. Images are first scaled to [0, 1]; with ``normalize`` they
    are then standardised with the per-channel mean/std of the *train* split (stored in
    ``bundle.meta["mean"]`` / ``["std"]``). For adult it standardises the numeric columns
    with train mean/std. synthetic_linear ignores it.
``synthetic``
    Sub-section for synthetic_linear (see :mod:`task.data.synthetic`): ``d`` (20), ``k`` (2),
    ``n_train`` (10 per client), ``n_test`` (100 per client), ``noise`` (0.01, std),
    ``head_scale`` (1.0), ``seed`` (0). The number of tasks is ``data.num_clients``
    (default 100); ``group`` is the task (client) id.

Source-specific keys live with their readers: ``split_seed`` / ``test_fraction``
(:mod:`task.data.datasets.digits`), ``hub_id`` / ``split_seed`` / ``femnist_test_fraction``
(:mod:`task.data.datasets.hub`), ``femnist_classes`` (:mod:`task.data.datasets.femnist`),
``image_channels`` (:mod:`task.data.datasets.image_folder`), ``adult_missing`` /
``adult_include_protected`` and the adult encoding (:mod:`task.data.datasets.adult`).

Every bad value or file raises :class:`task.errors.ConfigError` naming the key or file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from task.data.datasets.adult import load_adult
from task.data.datasets.bundle import ArrayData, DataBundle
from task.data.datasets.cache import load_npz, save_npz_atomic
from task.data.datasets.cifar import load_cifar
from task.data.datasets.config import (
    cache_dir_from_cfg,
    cfg_get,
    get_bool,
    get_choice,
    get_float,
    get_int,
    to_plain,
)
from task.data.datasets.digits import load_digits
from task.data.datasets.femnist import load_femnist_local
from task.data.datasets.hub import HUB_DEFAULTS, load_hub
from task.data.datasets.idx import load_idx, read_idx
from task.data.datasets.image_folder import load_image_folder
from task.data.datasets.images import normalize_images
from task.data.home import missing_data_error, resolve_root
from task.errors import ConfigError

APP_DIR = Path(__file__).resolve().parents[2]  # the app's root

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
    "synthetic_quadratic",
)


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
        return load_digits(data_cfg, normalize)
    if name == "synthetic_linear":
        from task.data.synthetic import bundle_from_cfg

        return bundle_from_cfg(data_cfg)
    if name == "synthetic_quadratic":
        from task.data.synthetic_quadratic import bundle_from_cfg as quadratic_bundle

        return quadratic_bundle(data_cfg)
    if source == "hub":
        if name not in HUB_DEFAULTS:
            raise ConfigError(
                f"data.source='hub' is not supported for data.name={name!r}: use data.source=local "
                f"(hub is available for {', '.join(HUB_DEFAULTS)})"
            )
        return load_hub(name, data_cfg, cache_dir, normalize)

    root = _root_from_cfg(data_cfg, name)
    if name in ("mnist", "fashion_mnist"):
        bundle = load_idx(name, root)
    elif name in ("cifar10", "cifar100"):
        bundle = load_cifar(name, root, data_cfg, cache_dir)
    elif name == "image_folder":
        bundle = load_image_folder(root, data_cfg, cache_dir, expected_classes=None)
    elif name == "femnist":
        bundle = load_femnist_local(root, data_cfg, cache_dir)
    elif name == "adult":
        return load_adult(root, data_cfg, normalize)
    else:  # pragma: no cover - guarded by DATASET_NAMES
        raise ConfigError(f"data.name={name!r} is not implemented")
    if normalize:
        normalize_images(bundle)
    return bundle


def _root_from_cfg(data_cfg: Mapping, name: str) -> Path:
    value = cfg_get(data_cfg, "root", None)
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"data.root={value!r} is invalid: expected a directory path")
    root = resolve_root(name, value)
    if root is None:
        raise ConfigError(
            f"data.root is required for data.name={name!r} with data.source=local: "
            "set it to the directory holding the dataset files"
        )
    if not root.exists():
        raise missing_data_error(name, root)
    return root


__all__ = [
    "ArrayData",
    "DataBundle",
    "DATASET_NAMES",
    "HUB_DEFAULTS",
    "cache_dir_from_cfg",
    "cfg_get",
    "get_bool",
    "get_choice",
    "get_float",
    "get_int",
    "load_npz",
    "load_source",
    "normalize_images",
    "read_idx",
    "save_npz_atomic",
    "to_plain",
]
