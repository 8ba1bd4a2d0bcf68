"""``flrep diagnose`` on real runs: cosine heatmaps and summaries, CKA under fine-tuning (1 for a
model that fine-tuning does not change), transfer curves, and one figure with every model."""

import json

import pytest

from flower_app.cli import main as flrep
from flower_app.run.config import load_variants
from flower_app.app.server_app import run_variants
from tests.local_grid import LocalGrid

# digits 0-7 train the clients; the 4 held-out new clients hold digits 8 and 9
DATA = "data.num_new_clients=4 data.new_client_classes=[8,9] data.new_client_classes_per_client=2"
NEW = ["--clients", "quickstart", *DATA.split()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for algorithm in ("fedavg", "fedrep"):
        overrides = f"wandb.enabled=false compare=[] rounds=4 eval.final_window=1 algorithm={algorithm} {DATA} " \
                    f"out_dir={root / algorithm}"
        run_variants(LocalGrid(20, {"experiment": "quickstart", "overrides": overrides}),
                     load_variants("quickstart", overrides.split()))
    return root


def test_cosine_writes_a_heatmap_per_model_and_one_for_all(runs, tmp_path, capsys):
    assert flrep(["diagnose", "cosine", str(runs / "fedavg"), str(runs / "fedrep"), "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cosine.json").read_text())
    assert len(results) == 2 and all(p.stat().st_size > 0 for p in (tmp_path / "cosine.png", tmp_path / "cosine_0.png"))
    for summary in results.values():  # ReLU features: same-class images are more alike than different-class ones
        assert 0 < summary["mean_off_diagonal"] < summary["mean_diagonal"] <= 1
    assert (tmp_path / "cosine_1.csv").read_text().splitlines()[0].count(",") == 10
    assert "mean_diagonal" in capsys.readouterr().out


def test_cka_is_one_where_fine_tuning_changes_nothing_and_lower_where_it_does(runs, tmp_path):
    common = ["diagnose", "cka", str(runs / "fedavg"), *NEW, "--new-clients", "2", "--epochs", "2", "--samples", "20"]
    assert flrep([*common, "--out", str(tmp_path / "still"), "--lr", "0"]) == 0
    still = next(iter(json.loads((tmp_path / "still" / "cka.json").read_text()).values()))
    assert still["layers"] == ["fc1", "fc2"] and still["cka"] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert flrep([*common, "--out", str(tmp_path / "tuned"), "--lr", "0.5"]) == 0
    tuned = next(iter(json.loads((tmp_path / "tuned" / "cka.json").read_text()).values()))
    assert tuned["cka"][-1] < 0.999 and (tmp_path / "tuned" / "cka.png").stat().st_size > 0


def test_transfer_curves_improve_with_samples_on_unseen_classes(runs, tmp_path):
    assert flrep(["diagnose", "transfer", str(runs / "fedavg"), str(runs / "fedrep"), *NEW, "--new-clients", "2",
                  "--trials", "2", "--epochs", "5", "--samples", "0", "40", "--lr", "0.05", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "transfer.json").read_text())
    for curve in results.values():  # before fine-tuning the models (almost) never predict the unseen 8 and 9
        assert curve["samples_per_epoch"] == [0, 40] and curve["mean"][0] < 0.1 and curve["mean"][1] > 0.5
    assert (tmp_path / "transfer.png").stat().st_size > 0


def test_diagnose_names_a_missing_model_and_needs_new_clients(tmp_path, capsys):
    assert flrep(["diagnose", "cosine", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "neither a run directory nor a model file" in capsys.readouterr().err
    assert flrep(["diagnose", "transfer", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "--clients" in capsys.readouterr().err
