"""Image-folder datasets, as a directory or a ``.tar``, decoded into arrays.

``data.root`` layout (image_folder, and the cifar fallback): ``train/<class>/*.{jpg,jpeg,png}``
and ``test/<class>/*``, either as a directory, as a ``.tar`` file given as ``root``, or
as the single ``.tar`` file inside the ``root`` directory. Classes are the sorted
names of the ``train/`` class folders (for CIFAR-10 that is the standard order
airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck); all images
must have the same size. Decoded arrays are cached as ``.npz`` in ``cache_dir``
keyed by a hash of (path, size, mtime) of the tar / every image file.

Config keys (under ``data.``)
-----------------------------
``image_channels``
    1 or 3 (default 3): colour mode images of ``image_folder`` are converted to.
"""

from __future__ import annotations

import io
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from task.data.datasets.bundle import DataBundle
from task.data.datasets.cache import CACHE_VERSION, file_stamp, hash_key, load_npz, save_npz_atomic
from task.data.datasets.config import get_int
from task.data.datasets.images import image_bundle
from task.errors import ConfigError

_IMAGE_EXTS = (".jpg", ".jpeg", ".png")


def find_image_folder(root: Path) -> Path:
    """Resolve ``root`` to an image-folder directory or a ``.tar`` file."""
    if root.is_file():
        if tarfile.is_tarfile(root):
            return root
        raise ConfigError(f"{root}: not a tar archive; expected a .tar of train/<class>/* and test/<class>/*")
    if (root / "train").is_dir() and (root / "test").is_dir():
        return root
    tars = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(".tar"))
    if len(tars) == 1:
        return tars[0]
    if len(tars) > 1:
        raise ConfigError(
            f"data.root={str(root)!r} holds several .tar files ({', '.join(t.name for t in tars)}); "
            "set data.root to the one to use"
        )
    raise ConfigError(
        f"data.root={str(root)!r}: expected train/ and test/ class folders or a single .tar file holding them"
    )


def _split_class_from_parts(parts: Sequence[str]) -> tuple[str, str] | None:
    if len(parts) < 3 or parts[-3] not in ("train", "test"):
        return None
    if parts[-1].startswith(".") or not parts[-1].lower().endswith(_IMAGE_EXTS):
        return None
    return parts[-3], parts[-2]


def _decode_image(data: bytes | Path, where: str, mode: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return np.asarray(im.convert(mode), dtype=np.uint8)
    except Exception as exc:  # noqa: BLE001 - PIL raises many error types
        raise ConfigError(f"{where}: cannot decode image ({type(exc).__name__}: {exc}); expected a JPEG/PNG file") from exc


def _collect_image_entries(folder: Path) -> tuple[list[tuple[str, str, str]], list]:
    """Sorted (split, class, name) entries and a stamp list for the cache key."""
    entries: list[tuple[str, str, str]] = []
    if folder.is_file():
        try:
            with tarfile.open(folder) as tar:
                for m in tar.getmembers():
                    if not m.isfile():
                        continue
                    sc = _split_class_from_parts(m.name.split("/"))
                    if sc:
                        entries.append((sc[0], sc[1], m.name))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ConfigError(f"{folder}: cannot read the tar archive ({exc})") from exc
        stamp = [file_stamp(folder)]
    else:
        stamp = [str(folder.resolve())]
        for split in ("train", "test"):
            for cls_dir in sorted(p for p in (folder / split).iterdir() if p.is_dir()):
                images = [f for f in sorted(cls_dir.iterdir())
                          if f.is_file() and not f.name.startswith(".") and f.name.lower().endswith(_IMAGE_EXTS)]
                if not images:  # a class without images would silently vanish from the label set
                    raise ConfigError(f"{cls_dir}: class folder '{cls_dir.name}' has no images; expected "
                                      f"{'/'.join(_IMAGE_EXTS)} files (remove the folder to drop the class)")
                for f in images:
                    entries.append((split, cls_dir.name, str(f)))
                    st = f.stat()
                    stamp.append([f"{split}/{cls_dir.name}/{f.name}", st.st_size, st.st_mtime_ns])
    entries.sort(key=lambda e: (e[0], e[1], Path(e[2]).name, e[2]))
    return entries, stamp


def load_image_folder(root: Path, data_cfg: Mapping, cache_dir: Path, expected_classes: int | None,
                      channels: int | None = None) -> DataBundle:
    """Decode (or load from cache) the image folder or tar at ``root``."""
    folder = find_image_folder(root)
    if channels is None:
        channels = get_int(data_cfg, "image_channels", 3, lo=1, hi=3)
        if channels == 2:
            raise ConfigError("data.image_channels=2 is invalid: expected 1 or 3")
    mode = "RGB" if channels == 3 else "L"
    entries, stamp = _collect_image_entries(folder)
    key = hash_key("imgfolder", CACHE_VERSION, mode, stamp)
    cache_file = cache_dir / "decoded" / f"imgfolder-{key[:32]}.npz"
    cached = load_npz(cache_file)
    if cached is not None:
        classes = [str(c) for c in cached["classes"]]
        xtr, ytr, xte, yte = cached["x_train"], cached["y_train"], cached["x_test"], cached["y_test"]
    else:
        classes = sorted({c for s, c, _ in entries if s == "train"})
        test_classes = sorted({c for s, c, _ in entries if s == "test"})
        if not classes:
            raise ConfigError(f"{folder}: no images found under train/<class>/; expected *.jpg/*.jpeg/*.png files")
        if not test_classes:
            raise ConfigError(f"{folder}: no images found under test/<class>/; expected *.jpg/*.jpeg/*.png files")
        unknown = sorted(set(test_classes) - set(classes))
        if unknown:
            raise ConfigError(f"{folder}: test classes {unknown} have no train/ folder; expected the same class folders")
        cls_index = {c: i for i, c in enumerate(classes)}
        images: list[np.ndarray] = []
        print(f"[flrep] decoding {len(entries):,} images of {folder} (once: cached in {cache_file.parent})",
              file=sys.stderr, flush=True)
        progress = tqdm(entries, desc="[flrep] decoding", unit="img", disable=None, mininterval=1.0)
        if folder.is_file():
            with tarfile.open(folder) as tar:
                members = {m.name: m for m in tar.getmembers() if m.isfile()}
                for _, _, name in progress:
                    fh = tar.extractfile(members[name])
                    images.append(_decode_image(fh.read(), f"{folder}:{name}", mode))
        else:
            for _, _, name in progress:
                images.append(_decode_image(Path(name), name, mode))
        ref = next(i for i, e in enumerate(entries) if e[0] == "train")
        shape0 = images[ref].shape
        for img, (_, _, name) in zip(images, entries):
            if img.shape != shape0:
                where = f"{folder}:{name}" if folder.is_file() else name
                raise ConfigError(
                    f"{where}: image size {img.shape} differs from {shape0} (first train image); "
                    "expected all images the same size"
                )
        split = np.array([s == "train" for s, _, _ in entries])
        labels = np.array([cls_index[c] for _, c, _ in entries], dtype=np.int64)
        x = np.stack(images)
        xtr, ytr, xte, yte = x[split], labels[split], x[~split], labels[~split]
        save_npz_atomic(cache_file, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte,
                        classes=np.array(classes))
    if expected_classes is not None and len(classes) != expected_classes:
        raise ConfigError(
            f"{folder}: found {len(classes)} class folders ({', '.join(classes[:12])}...); expected {expected_classes}"
        )
    return image_bundle(xtr, ytr, xte, yte, len(classes), classes)
