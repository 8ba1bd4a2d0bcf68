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


def home_origin() -> str:
    """Where the data home came from, in words: ``FLREP_DATA`` or the default."""
    if os.environ.get(HOME_ENV):
        return f"set by {HOME_ENV}"
    return f"the default; {HOME_ENV} is unset"


def missing_data_error(name: str, path: Path, failure: str | None = None) -> ConfigError:
    """The error for dataset files that are not at ``path``, a few short lines: where, what, why
    (``failure``: how a download just failed) and what to do that can work from here."""
    if not path.is_relative_to(data_home()):
        return ConfigError(f"data.root={str(path)!r} does not exist: expected the folder holding the {name} files")
    entry = home_folder_of(path)
    lines = [f"data: no {name} files at {path}"]
    if entry is None:
        lines.append(f"  the data home's known folders: {', '.join(HOME_FOLDERS)}")
    else:
        lines.append(f"  expected: {entry.files}")
    if failure:
        lines.append(f"  the download failed: {failure}")
    ways = [f"copy the files into {path}", f"point {HOME_ENV} at a data home that has them",
            "or set data.root=<the folder that holds them>"]
    if entry is not None and entry.fetchable and not failure:
        ways.insert(0, f"`flrep data fetch {entry.folder}` (downloads from {entry.source})")
    elif entry is not None and not entry.fetchable:
        ways.insert(0, f"build them by hand ({entry.source})")
    lines.append("  to fix: " + ", ".join(ways))
    lines.append(f"  the data home is {data_home()} ({home_origin()})")
    return ConfigError("\n".join(lines))


def fetcher(entry: HomeFolder) -> Callable[[Path], None]:
    """The function that downloads ``entry`` into a folder (:mod:`task.data.fetch`)."""
    from task.data import fetch

    return fetch.FETCHERS[entry.folder]
