"""A run that did not learn fails (docs/reliability.md): at a diverging learning rate, a
personalized method (FedRep, LG-FedAvg, Ditto) and a global-model method (FedAvg) end failed,
naming what went wrong, and a personalized run is judged against each client's own majority label."""

from __future__ import annotations

import numpy as np
import pytest

from flower_app.app.outcome import diverged, no_better_than_chance
from flower_app.app.server_app import Experiment
from flower_app.run.config import load_config
from tests.local_grid import LocalGrid

TINY = "wandb.enabled=false compare=[] data.num_clients=6 train.fraction=1.0 rounds=5 eval.final_window=1"


@pytest.mark.parametrize("algorithm", ["fedrep", "lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2]", "ditto", "fedavg"])
def test_a_diverging_learning_rate_fails_the_run(tmp_path, algorithm):
    overrides = f"{TINY} algorithm={algorithm} train.lr=1e4 out_dir={tmp_path}"
    grid = LocalGrid(6, {"experiment": "quickstart", "overrides": overrides}, client_errors=True)
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "failed", summary
    assert "the run diverged" in summary["failure_reason"], summary["failure_reason"]


def test_a_loss_that_is_not_a_number_or_explodes_is_named_with_its_round():
    healthy = [{"round": 1, "phase": "train", "train_loss": 0.4}, {"round": 1, "phase": "eval", "personalized_loss": 0.3}]
    assert diverged(healthy, 10) is None
    assert "round 2: train loss is nan" in diverged([*healthy, {"round": 2, "phase": "train", "train_loss": float("nan")}], 10)
    exploded = [*healthy, {"round": 2, "phase": "eval", "personalized_loss": 336.0}]
    assert "round 2: personalized loss 336 is above 10 × ln(10)" in diverged(exploded, 10)
    assert diverged(exploded, None) is None  # regression: no scale to judge by, only non-finite values


class _Bundle:
    task = "classification"

    def __init__(self, y):
        self.test = type("Split", (), {"y": np.asarray(y)})()


class _Data:
    def __init__(self, y, client_test, global_test):
        self.bundle, self.client_test, self.global_test = _Bundle(y), client_test, np.asarray(global_test)


def test_personalized_accuracy_must_beat_each_clients_own_majority_label():
    # client 0: labels 1 1 1 0 (majority 0.75); client 1: labels 2 2 3 3 (0.5): one client, one vote: 0.625
    data = _Data([1, 1, 1, 0, 2, 2, 3, 3], [np.arange(0, 4), np.arange(4, 8)], [])
    reason = no_better_than_chance({"global_accuracy": None, "personalized_accuracy": 0.6}, data, [0, 1])
    assert "0.6000 is no better than each client always predicting its own most frequent test label (0.6250)" in reason
    assert no_better_than_chance({"global_accuracy": None, "personalized_accuracy": 0.7}, data, [0, 1]) is None


def test_a_global_model_is_judged_against_the_pooled_majority():
    data = _Data([0, 0, 0, 1], [np.arange(4)], [0, 1, 2, 3])
    assert "always predicting the most frequent class" in no_better_than_chance(
        {"global_accuracy": 0.75, "personalized_accuracy": 0.99}, data, [0])
    assert no_better_than_chance({"global_accuracy": 0.8, "personalized_accuracy": 0.1}, data, [0]) is None
