"""Evidence: how much JPEG compression costs LeNet-5 on CIFAR-10 (docs/reproduction/lg_table1_cifar10).

Question. The only CIFAR-10 copy offline is a JPEG (quality 75) re-encoding. LG-FedAvg Table 1's
CIFAR-10 FedAvg row and New Test columns stay below the paper. Could the lossy copy explain it?
No lossless copy exists here, so the script measures the slope instead: it re-encodes the copy
at lower qualities and trains the same model centrally on each. If accuracy barely moves from
quality 75 down to 25, the step from lossless to 75 is unlikely to cost several points.

What it does (one thread, no Flower):

* data: the JPEG tar through the repo's image-folder loader (``load_image_folder``), then each
  variant re-encodes every train and test image with torchvision's ``encode_jpeg`` at that
  quality (``None``: the images as shipped); per-channel train statistics normalise, as a run;
* model: ``build_model("lenet5")``, the LG CIFAR-10 network, initialised with
  ``torch.manual_seed(seed)``;
* training: centrally, the clients' optimiser of lg_cifar10 (SGD lr 0.1, momentum 0.5,
  batch 50) with the run's ``crop_flip`` augmentation, ``--epochs`` passes over the 50,000
  images; test accuracy on the 10,000 test images after every epoch; ``--lr-drop``: the rate
  drops to 0.01 after that many epochs (how high LeNet-5 gets on the copy, centrally);
* ``--padding black``: the crop pads with black pixels (torchvision's RandomCrop before
  Normalize, as both official codes) instead of the repo's zeros after normalisation (the mean
  colour), a second difference from the official pipelines that this measures on the way.

Run (about 15 CPU-seconds an epoch on one thread):

    cd /work/main && . .venv/bin/activate && export FLREP_DATA=/work/shared/datasets
    python docs/reproduction/evidence/cifar10_jpeg_quality.py
    python docs/reproduction/evidence/cifar10_jpeg_quality.py --qualities none --padding black
    python docs/reproduction/evidence/cifar10_jpeg_quality.py --qualities none 25 --seeds 0 --epochs 60 --lr-drop 40
    python docs/reproduction/evidence/cifar10_jpeg_quality.py --psnr --qualities 90 75 50 25 10
    python docs/reproduction/evidence/cifar10_jpeg_quality.py --write-tar 50 /tmp/cifar10-q50.tar
    flrep run lg_cifar10 algorithm=local_only local_only.clients=all rounds=100 data.root=/tmp/cifar10-q50.tar
    python docs/reproduction/evidence/cifar10_jpeg_quality.py --write-tar chroma4 /tmp/cifar10-chroma4.tar

The copy's JPEG also stores colour at half resolution (4:2:0), which re-encoding keeps as it
is; ``chroma4`` halves it once more (a quarter of the resolution), losslessly stored, to measure
what colour resolution costs.

Adds its runs to ``cifar10_jpeg_quality.json`` next to itself and prints them.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torchvision.io import decode_jpeg, encode_jpeg, encode_png

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from task.data.datasets.image_folder import load_image_folder  # noqa: E402
from task.data.datasets.images import image_bundle, normalize_images  # noqa: E402
from task.data.home import data_home  # noqa: E402
from task.learning.engine import crop_flip  # noqa: E402
from task.learning.models import build_model  # noqa: E402

OUT = Path(__file__).with_suffix(".json")
TAR = "cifar10-jpeg/CIFAR-10-images-jpeg.tar"


def reencode(raw: np.ndarray, quality: int) -> np.ndarray:
    """uint8 (N, C, H, W) images, each JPEG-encoded at ``quality`` and decoded again."""
    out = np.empty_like(raw)
    for i, img in enumerate(torch.from_numpy(np.ascontiguousarray(raw))):
        out[i] = decode_jpeg(encode_jpeg(img, quality=quality)).numpy()
    return out


def quarter_chroma(raw: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, H, W) images with their colour (JPEG's Cb and Cr) at a quarter of the image's
    resolution in each direction, where the shipped copy's 4:2:0 JPEG keeps half: 4x4 block means,
    upsampled bilinearly; brightness (Y) untouched."""
    rgb = torch.from_numpy(raw).double()
    r, g, b = rgb.unbind(1)
    y = 0.299 * r + 0.587 * g + 0.114 * b
    chroma = torch.stack([-0.168736 * r - 0.331264 * g + 0.5 * b, 0.5 * r - 0.418688 * g - 0.081312 * b], 1)
    cb, cr = F.interpolate(F.avg_pool2d(chroma, 4), size=raw.shape[2:], mode="bilinear").unbind(1)
    out = torch.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb], 1)
    return out.round().clamp(0, 255).to(torch.uint8).numpy()


def degrade(raw: np.ndarray, variant: str) -> np.ndarray:
    """The images for one variant: ``none`` as shipped, ``chroma4`` ``quarter_chroma``, else the
    JPEG quality to re-encode at."""
    if variant == "none":
        return raw
    return quarter_chroma(raw) if variant == "chroma4" else reencode(raw, int(variant))


def write_tar(bundle, variant: str, path: Path) -> None:
    """The copy's ``variant`` as an image-folder tar (``train|test/<class>/<n>.jpg``, or ``.png``,
    lossless, for ``chroma4``), for a federated run on it (``data.root=<path>``)."""
    names = bundle.meta["class_names"]
    lossless = variant == "chroma4"
    ext = "png" if lossless else "jpg"
    with tarfile.open(path, "w") as tar:
        for split, data in (("train", bundle.train), ("test", bundle.test)):
            images = quarter_chroma(data.x.raw) if lossless else data.x.raw
            for i, (img, label) in enumerate(zip(torch.from_numpy(np.ascontiguousarray(images)), data.y)):
                blob = (encode_png(img) if lossless else encode_jpeg(img, quality=int(variant))).numpy().tobytes()
                info = tarfile.TarInfo(f"{split}/{names[label]}/{i:05d}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB) between two uint8 image arrays."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / mse))


def normalised(train_raw: np.ndarray, test_raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 train and test images, standardised as a run does (``normalize_images``: the train
    set's per-channel statistics), and a black pixel's normalised value (C, 1, 1)."""
    bundle = image_bundle(np.moveaxis(train_raw, 1, -1), np.zeros(len(train_raw)),
                          np.moveaxis(test_raw, 1, -1), np.zeros(len(test_raw)), 10)
    normalize_images(bundle)
    black = torch.from_numpy(-bundle.meta["mean"] / bundle.meta["std"]).reshape(-1, 1, 1)
    return torch.from_numpy(np.asarray(bundle.train.x)), torch.from_numpy(np.asarray(bundle.test.x)), black


def train_and_test(xtr: torch.Tensor, ytr: torch.Tensor, xte: torch.Tensor, yte: torch.Tensor, seed: int,
                   epochs: int, pad: torch.Tensor, lr_drop: int | None) -> list[float]:
    """Test accuracy after each epoch of central training (lg_cifar10's client optimiser);
    ``crop_flip`` pads with ``pad`` (per channel, normalised); the rate drops tenfold after
    ``lr_drop`` epochs."""
    torch.manual_seed(seed)
    model = build_model("lenet5", (3, 32, 32), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    gen = torch.Generator().manual_seed(seed)
    accuracies = []
    for epoch in range(epochs):
        if epoch == lr_drop:
            for group in opt.param_groups:
                group["lr"] *= 0.1
        model.train()
        for idx in torch.randperm(len(ytr), generator=gen).split(50):
            loss = F.cross_entropy(model(crop_flip(xtr[idx] - pad, gen) + pad), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(xte.split(1000), yte.split(1000)))
        accuracies.append(100.0 * correct / len(yte))
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qualities", nargs="+", default=["none", "50", "25", "10"],
                        help="re-encoding qualities; none = the copy as shipped (quality 75); "
                             "chroma4 = its colour at a quarter resolution (quarter_chroma)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr-drop", type=int, default=None,
                        help="after this many epochs the rate drops from 0.1 to 0.01 (default: never)")
    parser.add_argument("--write-tar", nargs=2, metavar=("QUALITY", "PATH"),
                        help="instead of training: write the copy's variant QUALITY (as --qualities) to the tar PATH")
    parser.add_argument("--psnr", action="store_true",
                        help="instead of training: each quality's PSNR against the copy as shipped")
    parser.add_argument("--padding", choices=["mean", "black"], default="mean",
                        help="crop_flip's padding: mean (zero after normalisation, the repo's) or black "
                             "(torchvision's RandomCrop before Normalize, the official codes')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        shipped = load_image_folder(data_home() / TAR, {}, Path(cache), 10)
    if args.write_tar:
        write_tar(shipped, args.write_tar[0], Path(args.write_tar[1]))
        return
    if args.psnr:
        saved = json.loads(OUT.read_text()) if OUT.exists() else {"runs": {}}
        raw = shipped.test.x.raw
        saved["test_psnr_db_vs_shipped"] = {q: psnr(raw, degrade(raw, q)) for q in args.qualities if q != "none"}
        OUT.write_text(json.dumps(saved, indent=1) + "\n")
        print(saved["test_psnr_db_vs_shipped"])
        return
    ytr, yte = torch.from_numpy(shipped.train.y), torch.from_numpy(shipped.test.y)
    results = json.loads(OUT.read_text())["runs"] if OUT.exists() else {}
    for q in args.qualities:
        quality = None if q in ("none", "chroma4") else int(q)
        train_raw, test_raw = degrade(shipped.train.x.raw, q), degrade(shipped.test.x.raw, q)
        xtr, xte, black = normalised(train_raw, test_raw)
        pad = black if args.padding == "black" else torch.zeros_like(black)
        for seed in args.seeds:
            start = time.time()
            curve = train_and_test(xtr, ytr, xte, yte, seed, args.epochs, pad, args.lr_drop)
            drop = f"/drop{args.lr_drop}" if args.lr_drop is not None else ""
            results[f"{q}/{args.padding}/{args.epochs}ep{drop}/seed{seed}"] = {
                "quality": quality, "padding": args.padding, "seed": seed, "epochs": args.epochs,
                "lr_drop": args.lr_drop, "test_accuracy": curve, "final": curve[-1], "best": max(curve),
                "seconds": time.time() - start}
            print(f"quality {q:>4} {args.padding} padding, seed {seed}: final {curve[-1]:.2f}, best {max(curve):.2f} "
                  f"({time.time() - start:.0f} s)", flush=True)
        saved = json.loads(OUT.read_text()) if OUT.exists() else {}
        OUT.write_text(json.dumps({**saved, "runs": results}, indent=1) + "\n")
    print(f"wrote {OUT}")  # after every variant: an interrupted run keeps the variants it finished


if __name__ == "__main__":
    main()
