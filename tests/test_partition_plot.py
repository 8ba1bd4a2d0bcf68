"""Each run's ``plots/partition.png``: the clients' training labels (clients x classes) and sizes,
written once at the start from the server's copy of the partition; sizes only for regression
data; none, said once in the log, when the nodes load their own data; never a reason to stop."""

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from flower_app.app.experiment import Experiment
from flower_app.results import contract, plots
from flower_app.results.contract import RunRecorder
from flower_app.run.config import load_config
from task.data.federated_data import build_federated_data, label_counts
from task.files import WriteFailed
from tests.local_grid import LocalGrid

TINY = ["wandb.enabled=false", "compare=[]", "data.num_clients=4", "rounds=1", "eval.final_window=1"]
PNG = b"\x89PNG"


def figures(monkeypatch) -> list[tuple[Figure, Path]]:
    """The figures the plots module saves, kept for inspection (nothing is written)."""
    saved = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: saved.append((fig, path)))
    return saved


def visible_axes(fig: Figure) -> list:
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def test_label_counts_match_the_partition():
    cfg = load_config("quickstart", ["data.num_clients=10", "data.num_new_clients=2"])
    fed = build_federated_data(cfg.data, int(cfg.seed))
    counts = label_counts(fed)
    labels = np.asarray(fed.bundle.train.y)
    assert counts.shape == (10, fed.bundle.num_classes) and counts.dtype == np.int64
    assert counts.sum(axis=1).tolist() == [len(idx) for idx in fed.client_train]
    for pid, idx in enumerate(fed.client_train):
        held = {int(c): int(n) for c, n in zip(*np.unique(labels[idx], return_counts=True))}
        assert {c: int(n) for c, n in enumerate(counts[pid]) if n} == held
    # pathological, 2 classes per client: each training client's row has at most 2 labels
    assert all((counts[p] > 0).sum() <= 2 for p in range(10) if p not in fed.new_clients)


def test_a_quickstart_run_writes_its_partition_picture(tmp_path, monkeypatch):
    out = tmp_path / "run"
    drawn = []
    real = contract.plot_partition
    monkeypatch.setattr(contract, "plot_partition", lambda *args: drawn.append(args) or real(*args))
    overrides = " ".join([*TINY, f"out_dir={out}"])
    experiment = Experiment(LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}),
                            load_config("quickstart", overrides.split()))
    experiment.run()
    picture = out / "plots" / "partition.png"
    assert picture.read_bytes().startswith(PNG)
    assert {p.name for p in (out / "plots").iterdir()} >= {"partition.png", "accuracy.png", "client_spread.png"}
    [(counts, sizes, path, title, held_out)] = drawn
    assert path == picture and held_out == {}
    assert np.array_equal(counts, label_counts(experiment.data))
    assert sizes.tolist() == counts.sum(axis=1).tolist() == [len(i) for i in experiment.data.client_train]

    # a resumed run keeps the picture it has: drawn once per run
    before = picture.stat().st_mtime_ns
    experiment.recorder.write_partition(experiment.data, experiment.name)
    assert len(drawn) == 1 and picture.stat().st_mtime_ns == before


def test_regression_data_gives_the_sizes_only_picture(tmp_path, monkeypatch):
    cfg = load_config("linear_fedrep", ["data.num_clients=12"])
    fed = build_federated_data(cfg.data, int(cfg.seed))
    assert label_counts(fed) is None
    RunRecorder(tmp_path, OmegaConf.create({})).write_partition(fed, "linear")
    assert (tmp_path / "plots" / "partition.png").read_bytes().startswith(PNG)

    saved = figures(monkeypatch)
    RunRecorder(tmp_path / "again", OmegaConf.create({})).write_partition(fed, "linear")
    [(fig, _)] = saved
    [ax] = visible_axes(fig)
    assert ax.get_xlabel() == "training samples" and len(ax.patches) == 12
    assert [p.get_width() for p in ax.patches] == [len(i) for i in fed.client_train]
    assert "regression" in fig._suptitle.get_text()


def test_the_picture_reads_for_10_and_for_1000_clients(tmp_path, monkeypatch):
    saved = figures(monkeypatch)
    rng = np.random.default_rng(0)
    drawn = {}
    for n in (10, 1000):
        drawn[n] = rng.integers(0, 50, size=(n, 10))
        plots.plot_partition(drawn[n], drawn[n].sum(axis=1), tmp_path / f"{n}.png", f"{n} clients", {n - 1: "new client"})
    for (fig, _), n in zip(saved, (10, 1000)):
        heatmap, sizes = visible_axes(fig)
        rows = heatmap.images[0].get_array()
        assert rows.shape == (n, 10) and any(ax.get_label() == "<colorbar>" for ax in fig.axes)
        assert sizes.get_legend().get_texts()[0].get_text() == "new client"
        if n == 10:  # partition-id order, one tick per client
            assert np.array_equal(rows.filled(0), drawn[n]) and len(sizes.patches) == n
            assert [t for t in sizes.get_yticks() if -0.5 <= t <= n - 0.5] == list(range(n))
        else:  # sorted by most frequent label, no per-client ticks
            assert sorted(map(tuple, rows.filled(0))) == sorted(map(tuple, drawn[n]))
            assert list(np.argmax(rows.filled(0), axis=1)) == sorted(np.argmax(rows.filled(0), axis=1))
            assert len(sizes.get_yticks()) == 0 and "sorted" in heatmap.get_ylabel()


def test_without_the_partition_no_picture_and_one_log_line(tmp_path, caplog):
    recorder = RunRecorder(tmp_path, OmegaConf.create({}))
    recorder.write_partition(None, "own data")
    assert not (tmp_path / "plots").exists()
    lines = [r.getMessage() for r in caplog.records if "partition.png" in r.getMessage()]
    assert len(lines) == 1 and "nodes load their own data" in lines[0]


def test_a_picture_that_cannot_be_drawn_never_stops_the_run(tmp_path, monkeypatch, caplog):
    fed = build_federated_data(load_config("quickstart", []).data, 0)

    def broken(*args):
        raise ValueError("no colours left")

    monkeypatch.setattr(contract, "plot_partition", broken)
    RunRecorder(tmp_path, OmegaConf.create({})).write_partition(fed, "broken")
    assert "plots/partition.png was not drawn: ValueError: no colours left" in caplog.text
    assert not (tmp_path / "plots").exists()


def test_a_full_disk_stops_the_run_as_for_every_result(tmp_path, monkeypatch):
    """Like every other plot (docs/reliability.md, full disks): the write fails naming the file."""
    fed = build_federated_data(load_config("quickstart", []).data, 0)

    def savefig(self, fname, **kwargs) -> None:
        Path(fname).write_bytes(PNG)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(WriteFailed, match="no space left on .*partition.png"):
        RunRecorder(tmp_path, OmegaConf.create({})).write_partition(fed, "full")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == []
