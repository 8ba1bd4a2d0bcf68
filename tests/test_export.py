"""``flrep export``: a run's model file holds exactly the run's global arrays over its seeded
initial model, reloads into the same predictions, and keeps client-only parts out."""

import json

import numpy as np
import pytest
import torch

from flower_app.app.checkpoint import read
from flower_app.cli import main as flrep
from flower_app.run.config import initial_model, load_config, load_variants
from flower_app.tools.export import load_model
from flower_app.app.server_app import run_variants
from task.data.federated_data import build_federated_data
from tests.local_grid import LocalGrid

RUN = "wandb.enabled=false compare=[] rounds=3 eval.final_window=1 train.fraction=1.0"


def _run(tmp_path, algorithm: str):
    out = tmp_path / algorithm
    overrides = f"{RUN} algorithm={algorithm} out_dir={out}"
    run_variants(LocalGrid(20, {"experiment": "quickstart", "overrides": overrides}),
                 load_variants("quickstart", overrides.split()))
    return out, load_config("quickstart", overrides.split())


def test_a_fedavg_model_reloads_to_the_runs_own_global_accuracy(tmp_path, capsys):
    out, cfg = _run(tmp_path, "fedavg")
    assert flrep(["export", str(out)]) == 0 and "model written to" in capsys.readouterr().out
    model, saved = load_model(out / "model.pt")
    assert saved["local_keys"] == [] and saved["run"]["round"] == 3 and saved["run"]["algorithm"] == "fedavg"
    data = build_federated_data(cfg.data, int(cfg.seed))
    x = torch.as_tensor(np.asarray(data.bundle.test.x[data.global_test]), dtype=torch.float32)
    y = np.asarray(data.bundle.test.y[data.global_test])
    with torch.no_grad():
        accuracy = float((model(x).argmax(1).numpy() == y).mean())
    summary = json.loads((out / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["global_accuracy_last"], abs=1e-6)


def test_a_fedrep_file_has_the_learned_body_and_only_the_initial_head(tmp_path):
    out, cfg = _run(tmp_path, "fedrep")
    assert flrep(["export", str(out), "--out", str(tmp_path / "fedrep.pt")]) == 0
    model, saved = load_model(tmp_path / "fedrep.pt")
    arrays = read(out, "test")["arrays"]
    initial = initial_model(cfg, build_federated_data(cfg.data, int(cfg.seed)).bundle).state_dict()
    state = model.state_dict()
    assert saved["local_keys"] == ["fc2.bias", "fc2.weight"] and set(saved["global_keys"]) == set(arrays)
    for key in saved["global_keys"]:
        assert np.array_equal(state[key].numpy(), arrays[key])
        assert not torch.equal(state[key], initial[key])  # the body was trained
    for key in saved["local_keys"]:
        assert torch.equal(state[key], initial[key])  # no client's head left its client


def test_an_lg_file_lists_the_warm_start_local_part_as_local(tmp_path):
    out = tmp_path / "lg"
    overrides = (f"{RUN} algorithm=lg_fedavg lg.global_part=[fc2] lg.fedavg_rounds=1 out_dir={out}").split()
    run_variants(LocalGrid(20, {"experiment": "quickstart", "overrides": " ".join(overrides)}),
                 load_variants("quickstart", overrides))
    model, saved = export_model_and_load(out)
    assert saved["global_keys"] == ["fc2.bias", "fc2.weight"]
    assert saved["local_keys"] == sorted(k for k in model.state_dict() if not k.startswith("fc2."))
    arrays = read(out, "test")["arrays"]  # the server keeps the whole model: the local part is the warm start's
    assert all(np.array_equal(model.state_dict()[k].numpy(), arrays[k]) for k in saved["local_keys"])


def export_model_and_load(run_dir):
    assert flrep(["export", str(run_dir)]) == 0
    return load_model(run_dir / "model.pt")


def test_export_refuses_a_folder_without_checkpoint_and_never_overwrites(tmp_path, capsys):
    assert flrep(["export", str(tmp_path)]) == 2 and "no server checkpoint" in capsys.readouterr().err
    out, _ = _run(tmp_path, "fedavg")
    (out / "model.pt").write_text("mine")
    assert flrep(["export", str(out)]) == 2 and "exists" in capsys.readouterr().err
    assert (out / "model.pt").read_text() == "mine"


def test_export_refuses_a_failed_run_and_names_its_failure(tmp_path, capsys):
    out, _ = _run(tmp_path, "fedavg")
    summary = json.loads((out / "summary.json").read_text())
    summary.update(status="failed", failure_reason="995 of 1000 training rounds were skipped")
    (out / "summary.json").write_text(json.dumps(summary))
    assert flrep(["export", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the run failed (995 of 1000 training rounds were skipped)" in err and str(out) in err
    assert not (out / "model.pt").exists()
    assert flrep(["diagnose", "cosine", str(out), "--out", str(tmp_path / "diag")]) == 2
    assert "the run failed" in capsys.readouterr().err and not (tmp_path / "diag").exists()
