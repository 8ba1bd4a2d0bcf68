"""The data home: where a dataset's files live when ``data.root`` is not an absolute path.

The data home is ``$FLREP_DATA``, else ``~/.cache/flrep/data``. ``data.root`` null means the
dataset's own folder there (:data:`DEFAULT_FOLDERS`, e.g. ``mnist``); a relative ``data.root``
is a path inside the data home (e.g. ``cifar10-jpeg/CIFAR-10-images-jpeg.tar``); an absolute one
is used as given. Each folder of the data home has a :class:`HomeFolder` entry: the files it
holds and how ``flrep data fetch`` gets them (:mod:`task.data.fetch`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from task.errors import ConfigError

HOME_ENV = "FLREP_DATA"
DEFAULT_HOME = "~/.cache/flrep/data"

# data.name -> its folder in the data home when data.root is null
DEFAULT_FOLDERS: dict[str, str] = {
    "mnist": "mnist",
    "fashion_mnist": "fashion-mnist",
    "cifar10": "cifar10",
    "cifar100": "cifar100",
    "femnist": "femnist",
    "adult": "adult",
}


@dataclass(frozen=True)
class HomeFolder:
    """One folder of the data home: what it holds and where that comes from."""

    folder: str
    dataset: str  # the data.name that reads it
    files: str  # the files expected, in words
    source: str  # where the files come from (docs/data.md lists sizes and licences)
    fetchable: bool  # whether `flrep data fetch` can download it (else: placed by hand, see `source`)


HOME_FOLDERS: dict[str, HomeFolder] = {f.folder: f for f in (
    HomeFolder("mnist", "mnist", "the four MNIST IDX files (train-images-idx3-ubyte.gz, ...), in the folder or in MNIST/raw/",
               "torchvision.datasets.MNIST (md5-checked)", True),
    HomeFolder("fashion-mnist", "fashion_mnist", "the four Fashion-MNIST IDX files, in the folder or in FashionMNIST/raw/",
               "torchvision.datasets.FashionMNIST (md5-checked)", True),
    HomeFolder("cifar10", "cifar10", "cifar-10-batches-py/ (data_batch_1..5, test_batch)",
               "torchvision.datasets.CIFAR10 (md5-checked)", True),
    HomeFolder("cifar100", "cifar100", "cifar-100-python/ (train, test)",
               "torchvision.datasets.CIFAR100 (md5-checked)", True),
    HomeFolder("cifar10-jpeg", "image_folder", "CIFAR-10-images-jpeg.tar (train/<class>/*.jpg, test/<class>/*.jpg)",
               "CIFAR-10 (torchvision, md5-checked) re-encoded as JPEG quality 75: the copy the CIFAR-10 "
               "experiments were measured on", True),
    HomeFolder("adult", "adult", "adult.data, adult.test (and adult.names)",
               "the UCI Machine Learning Repository (md5-checked)", True),
    HomeFolder("femnist", "femnist", "LEAF FEMNIST json: train/*.json and test/*.json",
               "LEAF's own scripts (github.com/TalwalkarLab/leaf, data/femnist/preprocess.sh) build the json by hand; "
               "data.source=hub reads the Hub copy flwrlabs/femnist instead", False),
)}


def data_home() -> Path:
    """The data home: ``$FLREP_DATA``, else ``~/.cache/flrep/data``."""
    return Path(os.path.abspath(os.path.expanduser(os.environ.get(HOME_ENV) or DEFAULT_HOME)))


def resolve_root(name: str, root: str | os.PathLike | None) -> Path | None:
    """The absolute path ``data.root`` means for dataset ``name`` (None: the dataset reads no files)."""
    if root is None or root == "":
        folder = DEFAULT_FOLDERS.get(name)
        return None if folder is None else data_home() / folder
    path = Path(os.path.expanduser(os.fspath(root)))
    return Path(os.path.abspath(path if path.is_absolute() else data_home() / path))


def home_folder_of(path: Path) -> HomeFolder | None:
    """The data-home entry ``path`` lies in (None when it is outside the data home or unknown)."""
    if not path.is_relative_to(data_home()):
        return None
    relative = path.relative_to(data_home())
    return HOME_FOLDERS.get(relative.parts[0]) if relative.parts else None


def missing_data_error(name: str, path: Path) -> ConfigError:
    """The error for dataset files that are not at ``path``: where, what and how to get them."""
    if not path.is_relative_to(data_home()):
        return ConfigError(f"data.root={str(path)!r} does not exist: expected the folder holding the {name} files")
    entry = home_folder_of(path)
    if entry is None:
        what = f"; the data home's known folders: {', '.join(HOME_FOLDERS)}"
    elif entry.fetchable:
        what = f": expected {entry.files}; run `flrep data fetch {entry.folder}` (source: {entry.source})"
    else:
        what = f": expected {entry.files}; place them by hand ({entry.source})"
    return ConfigError(f"data: no {name} files at {path} (the data home {data_home()}, set by {HOME_ENV}){what}, "
                       "or set data.root to a folder that holds them")


def fetcher(entry: HomeFolder) -> Callable[[Path], None]:
    """The function that downloads ``entry`` into a folder (:mod:`task.data.fetch`)."""
    from task.data import fetch

    return fetch.FETCHERS[entry.folder]
