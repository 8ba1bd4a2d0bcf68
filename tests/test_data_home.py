"""The data home: where data.root points, the error when files are absent, and the downloads
(tested against local stand-ins: the offline copies or generated files served over HTTP on
loopback, never the network)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import pickle
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flower_app.run.config import load_config
from flower_app.run.precheck import quick_check
from offline_data import shared
from task.data import fetch
from task.data.home import resolve_root
from task.data.sources import load_source
from task.errors import ConfigError

APP = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty data home."""
    path = tmp_path / "home"
    monkeypatch.setenv("FLREP_DATA", str(path))
    return path


def test_root_null_relative_and_absolute(home, tmp_path):
    assert resolve_root("mnist", None) == home / "mnist"
    assert resolve_root("fashion_mnist", None) == home / "fashion-mnist"
    assert resolve_root("image_folder", "cifar10-jpeg/x.tar") == home / "cifar10-jpeg" / "x.tar"
    assert resolve_root("mnist", str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"
    assert resolve_root("digits", None) is None
    assert load_config("lg_mnist").data.root == str(home / "mnist")


def test_no_experiment_names_the_shared_folder():
    named = [p.name for p in (APP / "conf").rglob("*.yaml") if "../shared" in p.read_text()]
    assert named == []


@pytest.fixture
def serve():
    """Serve folders over HTTP on loopback ; their base URLs."""
    servers = []

    def url_of(folder: Path) -> str:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"
    yield url_of
    for server in servers:
        server.shutdown()


def test_a_failed_download_says_what_can_work_and_leaves_nothing(home, tmp_path, monkeypatch, serve):
    (tmp_path / "empty").mkdir()
    monkeypatch.setitem(fetch.URLS, "mnist", [serve(tmp_path / "empty")])  # answers 404 to every file
    with pytest.raises(ConfigError) as err:
        quick_check("lg_mnist", [])
    lines = str(err.value).splitlines()
    assert lines[0] == f"data: no mnist files at {home / 'mnist'}" and "train-images-idx3-ubyte" in lines[1]
    assert lines[2].startswith("  the download failed: ") and "404" in lines[2]
    assert lines[3] == (f"  to fix: copy the files into {home / 'mnist'}, point FLREP_DATA at a data home that has "
                        "them, or set data.root=<the folder that holds them>")  # not "run flrep data fetch" again
    assert lines[4] == f"  the data home is {home} (set by FLREP_DATA)"
    assert [p.name for p in home.iterdir()] == []  # the failed download left nothing


def _closed_port_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/mnist/"


def test_offline_fetch_fails_in_under_2_s_without_importing_torchvision(tmp_path):
    """No host answers: `flrep data fetch` says so at once, and truthfully that the data home is the default."""
    script = ("import sys, time; from task.data import fetch; from flower_app.cli import main; "
              f"fetch.URLS['mnist'] = [{_closed_port_url()!r}]; start = time.monotonic(); code = main(['data', 'fetch', 'mnist']); "
              "print(code, time.monotonic() - start, 'torchvision' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "FLREP_DATA" and "proxy" not in k.lower()}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=APP, timeout=60,
                          env={**env, "HOME": str(tmp_path)})
    code, seconds, imported = proc.stdout.split()
    assert (code, imported) == ("2", "False") and float(seconds) < 2, proc.stdout
    assert "no connection to http://127.0.0.1:" in proc.stderr and "flrep data fetch" not in proc.stderr
    assert f"the data home is {tmp_path / '.cache/flrep/data'} (the default; FLREP_DATA is unset)" in proc.stderr
    assert len(proc.stderr.splitlines()) == 5 and not (tmp_path / ".cache").exists()


def test_the_download_urls_are_torchvisions_own():
    from torchvision import datasets

    assert fetch.URLS["mnist"] == datasets.MNIST.mirrors
    assert fetch.URLS["fashion-mnist"] == datasets.FashionMNIST.mirrors
    assert (fetch.URLS["cifar10"], fetch.URLS["cifar100"]) == ([datasets.CIFAR10.url], [datasets.CIFAR100.url])


def test_run_with_absent_root_exits_2_in_seconds(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flower_app.cli", "run", "lg_mnist", f"data.root={tmp_path / 'absent'}",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=APP, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert str(tmp_path / "absent") in proc.stderr
    assert time.monotonic() - start < 30
    assert not (tmp_path / "out").exists()


def test_mnist_download_from_a_local_mirror(home, tmp_path, monkeypatch, serve):
    monkeypatch.setitem(fetch.URLS, "mnist", [serve(shared("mnist"))])
    quick_check("lg_mnist", [])  # downloads into the data home
    assert (home / "mnist" / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").is_file()
    fetched = load_source({"name": "mnist", "normalize": False})
    original = load_source({"name": "mnist", "root": str(shared("mnist")), "normalize": False})
    assert len(fetched.train.y) == 60000 and np.array_equal(fetched.train.y, original.train.y)
    assert np.array_equal(np.asarray(fetched.test.x), np.asarray(original.test.x))


def test_a_bad_checksum_is_refused_and_leaves_nothing(home, tmp_path, monkeypatch, serve):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for f in shared("mnist").iterdir():
        (mirror / f.name).write_bytes(f.read_bytes()[:-10] + b"0123456789")  # same size, other bytes
    monkeypatch.setitem(fetch.URLS, "mnist", [serve(mirror)])
    with pytest.raises(ConfigError, match="download failed"):
        fetch.fetch_folder("mnist")
    assert list(home.iterdir()) == []


def test_adult_download_from_a_local_mirror(home, monkeypatch, serve):
    monkeypatch.setitem(fetch.URLS, "adult", [serve(shared("adult"))])
    assert fetch.fetch_folder("adult") == home / "adult"
    bundle = load_source({"name": "adult"})
    assert len(bundle.train.y) > 30000


def _fake_cifar10_archive(folder: Path) -> tuple[str, np.ndarray, np.ndarray]:
    """A CIFAR-10 python archive with 2 images per class and batch; its md5, images and labels."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 2)
    buffer = io.BytesIO()
    images = []
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            smooth = np.kron(rng.integers(0, 256, (20, 3, 4, 4)), np.ones((1, 1, 8, 8))).astype(np.uint8)
            images.append(smooth)
            body = pickle.dumps({b"data": smooth.reshape(20, -1), b"labels": labels.tolist()})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    path = folder / "cifar-10-python.tar.gz"
    path.write_bytes(buffer.getvalue())
    return hashlib.md5(path.read_bytes()).hexdigest(), np.concatenate(images[:5]), np.tile(labels, 5)


def test_cifar10_jpeg_copy_is_built_from_a_downloaded_cifar10(home, tmp_path, monkeypatch, serve):
    from torchvision.datasets import CIFAR10

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    md5, train_images, train_labels = _fake_cifar10_archive(mirror)
    monkeypatch.setitem(fetch.URLS, "cifar10", [serve(mirror) + "cifar-10-python.tar.gz"])
    monkeypatch.setattr(CIFAR10, "tgz_md5", md5)
    quick_check("fedrep_cifar10_100x2", [])  # builds cifar10 and then the JPEG copy
    assert (home / "cifar10" / "cifar-10-batches-py" / "test_batch").is_file()
    with tarfile.open(home / "cifar10-jpeg" / "CIFAR-10-images-jpeg.tar") as tar:
        names = tar.getnames()
    assert "train/airplane/0000.jpg" in names and "test/truck/0001.jpg" in names and len(names) == 120
    bundle = load_source(dict(load_config("fedrep_cifar10_100x2").data, normalize=False, cache_dir=str(tmp_path / "c")))
    assert np.array_equal(np.sort(bundle.train.y), np.sort(train_labels))
    first_airplane = np.asarray(bundle.train.x)[np.flatnonzero(bundle.train.y == 0)[0]]
    decoded = first_airplane if first_airplane.shape[-1] == 3 else first_airplane.transpose(1, 2, 0)
    errors = [np.abs(decoded - image.transpose(1, 2, 0) / 255.0).mean() for image in train_images]
    assert errors[0] < 0.06 and errors[0] < min(errors[1:]) / 3  # lossy (quality 75), and the right image


def test_flrep_data_lists_the_home(home, capsys):
    from flower_app.cli import main

    (home / "adult").mkdir(parents=True)
    assert main(["data"]) == 0
    out = capsys.readouterr().out
    assert str(home) in out and "adult" in out and "present" in out and "flrep data fetch mnist" in out


def test_a_fetch_removes_what_a_killed_fetch_left_and_keeps_a_live_ones(home, tmp_path, monkeypatch, serve):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    home.mkdir(parents=True, exist_ok=True)
    killed = home / f".adult.partial-{dead}-k1ll3d"
    live = home / f".adult.partial-{os.getpid()}-l1v3"
    other = home / f".mnist.partial-{dead}-0ther"
    for folder in (killed, live, other):
        (folder / "part").mkdir(parents=True)
    monkeypatch.setitem(fetch.URLS, "adult", [serve(tmp_path)])  # a host that answers
    monkeypatch.setitem(fetch.FETCHERS, "adult", lambda dst: (dst / "adult.data").write_text("x\n"))
    assert fetch.fetch_folder("adult") == home / "adult"
    assert (home / "adult" / "adult.data").is_file()
    assert not killed.exists() and live.exists() and other.exists()  # another folder's fetch: not this one's to judge
