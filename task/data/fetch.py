"""Downloading a data-home folder (``flrep data fetch``, and ``flrep run`` when the files are absent).

Each fetcher writes one folder of :data:`task.data.home.HOME_FOLDERS` through torchvision's own
downloads (progress bar, md5 check, mirrors). :func:`fetch_folder` downloads into a temporary
folder beside the target and renames it into place, so a failed download leaves nothing behind;
the temporary folder of a killed download is removed by the next fetch of that folder.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import getproxies

from task.data.home import HOME_FOLDERS, data_home, missing_data_error
from task.errors import ConfigError

# Where each fetchable folder's files are downloaded from, tried in order (torchvision's own
# mirrors for its datasets; tests/test_data_home.py checks they still match torchvision's).
URLS: dict[str, list[str]] = {
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"],
    "fashion-mnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
    "cifar10": ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"],
    "cifar100": ["https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"],
    "adult": ["https://archive.ics.uci.edu/ml/machine-learning-databases/adult/"],
}
PROBE_TIMEOUT_S = 1.0
ADULT_MD5 = {
    "adult.data": "5d7c39d7b8804f071cdd1f2a7c460872",
    "adult.test": "35238206dfdf7f1fe215bbb874adecdc",
    "adult.names": "1a7cdb3ff7a1b709968b1c7a11def63e",
}
JPEG_QUALITY = 75


def _idx(dataset: str, folder: str) -> Callable[[Path], None]:
    """The fetcher of a torchvision IDX dataset (MNIST, FashionMNIST) from :data:`URLS`."""
    def fetch(dst: Path) -> None:
        from torchvision import datasets

        cls = getattr(datasets, dataset)
        type(dataset, (cls,), {"mirrors": URLS[folder]})(str(dst), download=True)
    return fetch


def _cifar(dataset: str) -> Callable[[Path], None]:
    def fetch(dst: Path) -> None:
        from torchvision import datasets
        from torchvision.datasets.utils import download_and_extract_archive

        cls = datasets.CIFAR10 if dataset == "cifar10" else datasets.CIFAR100
        download_and_extract_archive(URLS[dataset][0], str(dst), filename=cls.filename, md5=cls.tgz_md5,
                                     remove_finished=True)
    return fetch


def _cifar10_jpeg(dst: Path) -> None:
    """CIFAR-10 re-encoded as ``CIFAR-10-images-jpeg.tar`` (``<split>/<class>/NNNN.jpg``, quality 75),
    from the data home's ``cifar10`` folder (downloaded first when absent)."""
    from PIL import Image

    from task.data.datasets.cifar import CIFAR10_CLASSES, load_cifar_arrays

    source = data_home() / "cifar10"
    if not (source / "cifar-10-batches-py").is_dir():
        fetch_folder("cifar10")
    splits = load_cifar_arrays("cifar10", source)
    with tarfile.open(dst / "CIFAR-10-images-jpeg.tar", "w") as tar:
        for split, (images, labels) in zip(("train", "test"), splits):
            for label, cls in enumerate(CIFAR10_CLASSES):
                for i, index in enumerate((labels == label).nonzero()[0]):
                    buffer = io.BytesIO()
                    Image.fromarray(images[index]).save(buffer, format="JPEG", quality=JPEG_QUALITY)
                    info = tarfile.TarInfo(f"{split}/{cls}/{i:04d}.jpg")
                    info.size = buffer.tell()
                    buffer.seek(0)
                    tar.addfile(info, buffer)


def _adult(dst: Path) -> None:
    from torchvision.datasets.utils import download_url

    for name, md5 in ADULT_MD5.items():
        download_url(URLS["adult"][0] + name, str(dst), filename=name, md5=md5)


FETCHERS: dict[str, Callable[[Path], None]] = {
    "mnist": _idx("MNIST", "mnist"),
    "fashion-mnist": _idx("FashionMNIST", "fashion-mnist"),
    "cifar10": _cifar("cifar10"),
    "cifar100": _cifar("cifar100"),
    "cifar10-jpeg": _cifar10_jpeg,
    "adult": _adult,
}


def unreachable(urls: list[str], timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why none of ``urls``' hosts takes a connection (None: one does), in about ``timeout``
    seconds a host: a download that cannot start fails before torchvision is even imported.
    Behind a proxy (``https_proxy`` and the like) nothing is probed: the download goes through it."""
    if getproxies():
        return None
    reasons = []
    for url in urls:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=timeout).close()
            return None
        except OSError as exc:
            reasons.append(f"{url} ({exc.strerror or type(exc).__name__})")
    return "no connection to " + ", ".join(reasons)


def _owner_alive(partial: Path) -> bool:
    """Whether the fetch that made ``partial`` (named ``.<folder>.partial-<pid>-<random>``) still runs."""
    pid = partial.name.rsplit(".partial-", 1)[-1].split("-", 1)[0]
    if not pid.isdigit():
        return False  # not a name of ours: no fetch owns it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def remove_stale_partials(folder: str) -> list[Path]:
    """Remove the temporary folders that killed fetches of ``folder`` left in the data home (a live
    fetch's stays); the removed ones."""
    stale = [p for p in data_home().glob(f".{folder}.partial-*") if p.is_dir() and not _owner_alive(p)]
    for partial in stale:
        shutil.rmtree(partial, ignore_errors=True)
    return stale


def fetch_folder(folder: str) -> Path:
    """Download data-home folder ``folder`` (a key of ``HOME_FOLDERS``) unless it is there; its path."""
    entry = HOME_FOLDERS.get(folder)
    if entry is None:
        raise ConfigError(f"data fetch: unknown dataset folder {folder!r}; known: {', '.join(HOME_FOLDERS)}")
    target = data_home() / folder
    if target.exists():
        return target
    if not entry.fetchable:
        raise missing_data_error(entry.dataset, target)
    offline = unreachable(URLS[folder]) if folder in URLS else None  # cifar10-jpeg: from a (fetched) cifar10
    if offline:
        raise missing_data_error(entry.dataset, target, offline)
    try:
        data_home().mkdir(parents=True, exist_ok=True)
        remove_stale_partials(folder)
        partial = Path(tempfile.mkdtemp(prefix=f".{folder}.partial-{os.getpid()}-", dir=data_home()))
    except OSError as exc:
        raise ConfigError(f"data: cannot write the data home {data_home()} ({exc}); set FLREP_DATA to a writable folder") from None
    try:
        source = f"from {URLS[folder][0]} " if folder in URLS else ""
        print(f"[data] downloading {folder} into {target} {source}({entry.source})", flush=True)
        FETCHERS[folder](partial)
        partial.chmod(0o755)
        partial.rename(target)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - no network, a bad checksum, a full disk, ...
        reason = " ".join(str(exc).split())[:300]
        raise missing_data_error(entry.dataset, target, f"{type(exc).__name__}: {reason}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
