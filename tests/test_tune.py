"""The validation split (``data.validation_fraction``) and ``flrep tune``: what is held out, what is
scored on it, and a choice made on validation accuracy alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flower_app.app.server_app import run_variants
from flower_app.cli import main as flrep
from flower_app.reproduction import runner, tables, tune
from flower_app.reproduction.runner import plan, reproduce
from flower_app.reproduction.tables import load_table
from flower_app.run.config import load_config, load_variants
from strategies.common import VALIDATION_ACCURACY, ClientRuntime
from strategies.evaluator import ServerEvaluator
from task.data.federated_data import build_federated_data
from task.data.validation import split_client
from task.errors import ConfigError
from task.learning.engine import TensorData
from task.learning.models import build_model
from tests.local_grid import LocalGrid
from tests.test_reproduce import TINY

TUNED = TINY.replace("paper: {acc: a_acc}, minutes: {cpu: 0.3}}",
                     "paper: {acc: a_acc}, minutes: {cpu: 0.3}, tune: {key: train.lr, grid: [0.05, 0.5]}}")


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(TUNED)
    monkeypatch.setattr(tables, "TABLES_DIR", folder)
    from flower_app.tools import bench_round

    monkeypatch.setattr(bench_round, "commit", lambda: "abc1234")
    return load_table("tiny")


# ------------------------------------------------------------------------------- the split


def test_a_client_holds_out_a_seeded_disjoint_share_of_its_training_samples():
    idx = np.arange(100, 150)
    train, held = split_client(idx, 0.2, seed=3, pid=7)
    assert len(held) == 10 and len(train) == 40
    assert set(train) | set(held) == set(idx) and not set(train) & set(held)
    assert list(train) == sorted(train) and list(held) == sorted(held)  # both keep the client's order
    again = split_client(idx, 0.2, seed=3, pid=7)
    assert np.array_equal(held, again[1])
    assert not np.array_equal(held, split_client(idx, 0.2, seed=3, pid=8)[1])  # each client its own draw
    assert not np.array_equal(held, split_client(idx, 0.2, seed=4, pid=7)[1])


def test_a_fraction_of_zero_changes_nothing_and_a_fraction_holds_out_per_client():
    cfg = load_config("quickstart", ["compare=[]"]).data
    plain = build_federated_data(cfg, 0)
    assert not plain.validating
    cut = build_federated_data({**cfg, "validation_fraction": 0.25}, 0)
    assert cut.validating and len(cut.client_validation) == plain.num_clients
    for whole, train, held in zip(plain.client_train, cut.client_train, cut.client_validation):
        assert sorted(np.concatenate([train, held])) == sorted(whole)
        assert len(held) == int(np.floor(0.25 * len(whole) + 0.5))
    assert all(np.array_equal(a, b) for a, b in zip(plain.client_test, cut.client_test))  # test splits untouched


@pytest.mark.parametrize("value, message", [
    ("1.0", "data.validation_fraction"), ("-0.1", "data.validation_fraction"), ("0.999", "data.validation_fraction"),
])
def test_a_bad_fraction_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        cfg = load_config("quickstart", ["compare=[]", f"data.validation_fraction={value}"])
        build_federated_data(cfg.data, 0)


def test_the_server_scores_each_client_on_its_own_held_out_samples():
    cfg = load_config("quickstart", ["compare=[]", "data.validation_fraction=0.3"])
    fed = build_federated_data(cfg.data, 0)
    torch.manual_seed(0)
    model = build_model("digits_mlp", tuple(fed.bundle.input_shape), fed.bundle.num_classes)
    evaluator = ServerEvaluator(fed, model, torch.device("cpu"), 64)
    got = evaluator.per_client_validation([0, 3, 5])
    train = fed.bundle.train
    for pid in (0, 3, 5):
        idx = fed.client_validation[pid]
        with torch.no_grad():
            pred = model(torch.as_tensor(np.asarray(train.x[idx]))).argmax(1).numpy()
        assert got[pid] == pytest.approx(float(np.mean(pred == train.y[idx])))


def test_a_client_reports_accuracy_on_its_validation_part_beside_its_test_accuracy():
    cfg = load_config("quickstart", ["compare=[]"])
    torch.manual_seed(0)
    model = build_model("digits_mlp", (1, 8, 8), 10)
    g = torch.Generator().manual_seed(1)
    data = [TensorData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in (30, 20, 40)]
    rt = ClientRuntime(cfg, 0, torch.device("cpu"), data[0], data[1], model, ["fc2"], {}, validation=data[2])
    out = rt.evaluate_local()
    with torch.no_grad():
        hand = float((model(data[2].x).argmax(1) == data[2].y).float().mean())
    assert out[VALIDATION_ACCURACY] == pytest.approx(hand) and out["accuracy"] != out[VALIDATION_ACCURACY]
    assert VALIDATION_ACCURACY not in ClientRuntime(cfg, 0, torch.device("cpu"), *data[:2], model, ["fc2"],
                                                   {}).evaluate_local()


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])  # scored on the server / by the clients
def test_a_run_with_a_validation_split_reports_validation_accuracy_each_round_and_in_its_summary(tmp_path, algorithm):
    def run(fraction):
        overrides = (f"algorithm={algorithm} compare=[] rounds=3 train.fraction=1.0 wandb.enabled=false "
                     f"out_dir={tmp_path / str(fraction)} "
                     f"data.validation_fraction={fraction}")
        grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
        summary = run_variants(grid, load_variants("quickstart", overrides))
        assert summary["status"] == "completed" and summary["failed_client_replies"] == 0
        train_sizes = [r.content["metrics"]["num-train"] for r in grid.replies if r.metadata.message_type == "query.info"]
        return summary, sum(float(np.asarray(v)) for v in train_sizes)

    plain, plain_train = run(0.0)
    held, held_train = run(0.25)
    assert "validation_accuracy" not in plain and "validation_fraction" not in plain
    assert held["validation_fraction"] == 0.25  # held-out samples share the test split's distribution:
    assert held["validation_accuracy"] == pytest.approx(held["personalized_accuracy"], abs=0.1)
    assert held_train == pytest.approx(0.75 * plain_train, rel=0.05)  # the clients train on the rest
    records = [json.loads(line) for line in (Path(held["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("phase") == "eval"]
    assert evals and all(r["personalized_validation_accuracy"] is not None for r in evals)


# ------------------------------------------------------------------------------- flrep tune


def _fake_runs(monkeypatch, scores: dict[str, tuple[float, float] | None]):
    """``flrep run`` replaced: the run of lr=<v> writes (test, validation) accuracy ``scores[v]``,
    or fails when it is None."""
    calls = []

    def run_child(cmd, log):
        lr = next(a.split("=", 1)[1] for a in cmd if a.startswith("train.lr="))
        assert "data.validation_fraction=0.2" in cmd
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        calls.append(lr)
        if scores[lr] is None:
            (folder / "summary.json").write_text(json.dumps({"status": "failed"}))
            return 1
        test, validation = scores[lr]
        (folder / "summary.json").write_text(json.dumps({"status": "completed", "personalized_accuracy": test,
                                                         "validation_accuracy": validation}))
        return 0

    monkeypatch.setattr(tune, "run_child", run_child)
    return calls


def test_tune_chooses_by_validation_accuracy_never_by_test_accuracy(tuned, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    calls = _fake_runs(monkeypatch, {"0.05": (0.9, 0.6), "0.5": (0.5, 0.7)})
    assert [j.cell.name for j in plan(tuned, [0], None, out)] == ["b"]  # a awaits its tuning: left out
    with pytest.raises(ConfigError, match="awaits its tuning of train.lr"):
        plan(tuned, [0], ["a"], out)
    assert tune.tune(tuned, "a", "cpu", out) == 0
    record = json.loads((out / "tuning" / "a.json").read_text())
    assert record["choice"] == 0.5 and record["mean"] == {"0.05": 0.6, "0.5": 0.7}
    assert {k: record[k] for k in ("key", "grid", "seeds", "fraction", "metric")} == {
        "key": "train.lr", "grid": [0.05, 0.5], "seeds": [0], "fraction": 0.2, "metric": "validation_accuracy"}
    assert (out / "tuning" / "a" / "train.lr=0.5" / "seed0.log").is_file()
    assert [j.tuned for j in plan(tuned, [0, 1], ["a"], out)] == [("train.lr=0.5",)] * 2  # the primary: all data
    assert "`a` train.lr = **0.5**" in (out / "table.md").read_text()
    assert tune.tune(tuned, "a", "cpu", out) == 0 and calls == ["0.05", "0.5"]  # kept runs are read, not run again


def test_a_failed_value_cannot_be_chosen_and_all_failing_is_recorded_as_differs(tuned, tmp_path, monkeypatch,
                                                                                 capsys):
    _fake_runs(monkeypatch, {"0.05": None, "0.5": (0.1, 0.2)})
    assert tune.tune(tuned, "a", "cpu", tmp_path / "one") == 0
    assert json.loads((tmp_path / "one" / "tuning" / "a.json").read_text())["mean"] == {"0.05": None, "0.5": 0.2}
    _fake_runs(monkeypatch, {"0.05": None, "0.5": None})
    none = tmp_path / "none"
    assert tune.tune(tuned, "a", "cpu", none) == 1
    record = json.loads((none / "tuning" / "a.json").read_text())
    assert record["choice"] is None and record["mean"] == {"0.05": None, "0.5": None}
    assert "every value failed; recorded in" in capsys.readouterr().out
    # nothing to run: left out of the table's runs, refused when asked for by name
    assert [j.cell.name for j in plan(tuned, [0], None, none)] == ["b"]
    with pytest.raises(ConfigError, match="every value of its tuning of train.lr failed"):
        plan(tuned, [0], ["a"], none)
    # the page says so (a primary's paper number then differs: test_reproduction_index)
    assert ("**Tuning found no value** (`flrep tune`): `a` train.lr: every value failed over seeds [0] "
            "(0.05: failed, 0.5: failed;") in (none / "table.md").read_text()


def test_a_tuning_record_made_for_another_grid_is_refused(tuned, tmp_path, monkeypatch):
    _fake_runs(monkeypatch, {"0.05": (0.9, 0.6), "0.5": (0.5, 0.7)})
    out = tmp_path / "out"
    assert tune.tune(tuned, "a", "cpu", out) == 0
    (tables.TABLES_DIR / "tiny.yaml").write_text(TUNED.replace("grid: [0.05, 0.5]", "grid: [0.05, 0.1]"))
    with pytest.raises(ConfigError, match="made for another tune: of cell 'a' \\(grid differ"):
        plan(load_table("tiny"), [0], ["a"], out)


def test_tune_refuses_a_cell_without_a_grid_naming_the_cells_that_have_one(tuned, tmp_path, capsys):
    assert flrep(["tune", "tiny", "b", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cell 'b' of table 'tiny' declares no tune:" in err and "cells that do: a" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_flrep_tune_runs_the_grid_for_real_and_reproduce_runs_the_choice(tuned, tmp_path, capsys):
    out = tmp_path / "out"
    assert flrep(["tune", "tiny", "a", "--out", str(out)]) == 0
    record = json.loads((out / "tuning" / "a.json").read_text())
    assert record["choice"] in (0.05, 0.5) and all(0 < m <= 1 for m in record["mean"].values())
    assert record["mean"][json.dumps(record["choice"])] == max(record["mean"].values())
    run = json.loads((out / "tuning" / "a" / "train.lr=0.5" / "seed0" / "summary.json").read_text())
    assert run["validation_fraction"] == 0.2 and run["failed_client_replies"] == 0
    assert reproduce(tuned, "cpu", [0], ["a"], out) == 0
    summary = json.loads((out / "runs" / "a" / "seed0" / "summary.json").read_text())
    assert "validation_accuracy" not in summary  # the primary trains on all of each client's data
    assert runner.stale_keys(tuned, "cpu", plan(tuned, [0], ["a"], out)[0], out / "runs" / "a" / "seed0") == []
