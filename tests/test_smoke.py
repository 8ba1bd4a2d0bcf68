"""``smoke=true`` (``flrep run --smoke``): every variant and phase of any experiment cut short,
and the command says what it shortened; ``rounds=N`` says which variant it does not reach."""

import json
import subprocess
import sys

import pytest

from flower_app.run.config import load_variants, shadowed_overrides
from flower_app.run.smoke import SMOKE_ROUNDS, describe_smoke
from flower_app.run.experiment_files import experiment_names


@pytest.mark.parametrize("name", experiment_names())
def test_every_experiment_has_a_valid_short_form(name):
    for cfg in load_variants(name, ["smoke=true"]):
        assert cfg.smoke and cfg.rounds <= SMOKE_ROUNDS, (cfg.label, cfg.rounds)
        assert (cfg.train.local_epochs <= 1) if cfg.train.local_steps is None else cfg.train.local_steps <= 10
        assert cfg.finetune.epochs <= 1 or not cfg.finetune.enabled
        assert cfg.new_clients.epochs <= 1 or not cfg.data.num_new_clients
        assert cfg.online.rounds <= 2 and cfg.online.start_accuracy is None or not cfg.data.online_device.enabled
        assert cfg.fair.pretrain_epochs <= 1 and cfg.fair.postfit_epochs <= 1 or cfg.model.name != "adult_fair"
        if cfg.algorithm == "fedrep":
            assert cfg.fedrep.head_epochs <= 1
        if cfg.algorithm == "tct":
            assert cfg.tct.stage1_rounds < cfg.rounds and cfg.tct.local_steps <= 10 and cfg.tct.features <= 1000
        if cfg.algorithm == "lg_fedavg":  # a one-round warm start, not one up to a goal a short run never reaches
            assert cfg.lg.goal_accuracy is None and cfg.lg.fedavg_rounds < cfg.rounds


def test_lg_mnist_is_shortened_in_every_variant_and_says_how():
    variants = load_variants("lg_mnist", ["smoke=true"])
    assert [(v.label, v.rounds) for v in variants] == [("lg_fedavg", 3), ("fedavg", 3), ("local_only", 3)]
    lg = variants[0].lg
    assert (lg.fedavg_rounds, lg.goal_accuracy, lg.lg_rounds) == (1, None, 2)
    lines = describe_smoke("lg_mnist", [])
    assert lines[0] == ("lg_fedavg: rounds 800 -> 3, lg.fedavg_rounds null -> 1, lg.goal_accuracy 0.975 -> null, "
                        "lg.lg_rounds 50 -> 2")
    assert lines[2] == "local_only: rounds 450 -> 3"


def test_a_smoke_run_of_an_already_short_experiment_changes_only_what_is_longer():
    assert describe_smoke("quickstart", ["rounds=2", "fedrep.head_epochs=1"]) == ["fedrep: already short",
                                                                                  "fedavg: already short"]


def test_rounds_says_which_variant_it_does_not_reach():
    lines = shadowed_overrides("lg_mnist", ["rounds=3"])
    assert lines == ["rounds=3 does not reach compare[1] ('algorithm=local_only rounds=450'): its own rounds=450 "
                     "wins (smoke=true shortens every variant)"]
    assert shadowed_overrides("lg_mnist", ["rounds=450"]) == [] and shadowed_overrides("quickstart", ["rounds=3"]) == []


def test_flrep_run_smoke_prints_what_it_shortened_and_the_summary_says_smoke(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flower_app.cli", "run", "quickstart", "--smoke", "wandb.enabled=false",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "smoke: fedrep: rounds 30 -> 3, fedrep.head_epochs 10 -> 1" in log
    assert "smoke: fedavg: rounds 30 -> 3" in log
    for variant in ("fedrep", "fedavg"):
        summary = json.loads((out / variant / "summary.json").read_text())
        assert summary["smoke"] is True and summary["rounds"] == 3 and summary["status"] == "completed"


def test_a_smoke_run_is_not_judged_on_learning_but_a_diverged_one_fails(tmp_path):
    from flower_app.app.server_app import run_variants
    from tests.local_grid import LocalGrid

    def run(out, extra):
        items = ["algorithm=fedrep", "compare=[]", "data.num_clients=4", "train.fraction=0.25", "smoke=true",
                 "wandb.enabled=false", f"out_dir={out}", *extra]
        return run_variants(LocalGrid(4, {"experiment": "quickstart", "overrides": " ".join(items)}),
                            load_variants("quickstart", items))

    unlearned = run(tmp_path / "a", ["train.lr=0.000001"])  # 3 rounds that barely move: learned nothing
    assert unlearned["status"] == "completed" and unlearned["smoke"] is True
    assert "failure_reason" not in unlearned
    judged = run(tmp_path / "c", ["train.lr=0.000001", "smoke=false", "rounds=3", "fedrep.head_epochs=1"])
    assert judged["status"] == "failed" and "learned nothing" in judged["failure_reason"]  # the same, not a smoke run
    exploded = run(tmp_path / "b", ["train.lr=10000"])
    assert exploded["status"] == "failed" and "diverged" in exploded["failure_reason"]


def test_under_flwr_run_the_serverapp_says_what_smoke_shortened_and_what_rounds_does_not_reach(tmp_path, monkeypatch):
    """No flrep command printed these lines: the ServerApp logs them (flat run-config keys)."""
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER

    from flower_app.app import server_app
    from flower_app.app.outcome import COMMAND_START_ENV
    from tests.local_grid import LocalGrid

    monkeypatch.delenv(COMMAND_START_ENV, raising=False)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    FLOWER_LOGGER.addHandler(handler)
    run_config = {"experiment": "quickstart", "overrides": "", "smoke": True, "data.num_clients": 4,
                  "wandb.enabled": False, "out_dir": str(tmp_path), "compare": "[algorithm=fedavg rounds=7]",
                  "rounds": 5}
    try:
        server_app.main(LocalGrid(4, run_config), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                          run_config=run_config))
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    assert any(line.startswith("[flrep] rounds=5 does not reach compare[0]") for line in lines), lines
    assert "[flrep] smoke: fedrep: rounds 5 -> 3, fedrep.head_epochs 10 -> 1" in lines
    assert "[flrep] smoke: fedavg: rounds 7 -> 3" in lines
