"""TCT: the closed-form stage-2 solver, standardisation by aggregated moments, the coordinate
subset on every client, what crosses the wire, and the variants end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from flower_app.run.config import load_config, load_variants
from flower_app.app.server_app import Experiment, run_variants
from strategies.common import ARRAYS
from strategies.scaffold import apply_deltas, control_update
from strategies.tct import FEATURES, MOMENTS, STANDARDIZATION, WEIGHTS
from task.tct.entk import entk_features, entk_setup
from task.errors import ConfigError
from task.data.federated_data import build_federated_data
from task.learning.models import build_model
from task.tct.linear import (FeatureMatrix, LocalLeastSquares, feature_moments, one_hot_targets, open_feature_file,
                      standardization)
from tests.local_grid import LocalGrid

P = 600  # eNTK coordinates in the end-to-end runs (digits_mlp with one logit has 4,225 parameters)


def _overrides(tmp_path, extra: str = "") -> str:
    return (f"wandb.enabled=false out_dir={tmp_path / 'out'} client_state.dir={tmp_path / 'state'} algorithm=tct "
            f"compare=[] data.num_clients=4 train.fraction=1.0 rounds=6 tct.stage1_rounds=2 tct.features={P} "
            f"tct.local_steps=50 tct.lr=0.002 tct.entk_batch_size=64 eval.final_window=1 {extra}")


def _run(tmp_path, extra: str = ""):
    overrides = _overrides(tmp_path, extra)
    cfg = load_config("quickstart", overrides.split())
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, cfg)
    summary = experiment.run()
    return cfg, grid, experiment, summary


@pytest.mark.parametrize("n, p", [(30, 50), (50, 20)])  # dual (n <= p) and primal side
def test_closed_form_local_gd_equals_explicit_steps(n, p):
    gen = torch.Generator().manual_seed(n)
    raw = torch.randn(n, p, generator=gen) * 2 + 1
    mean, std = standardization(*feature_moments(raw))
    problem = LocalLeastSquares(FeatureMatrix(raw, mean, std), one_hot_targets(torch.randint(0, 3, (n,), generator=gen), 3, False))
    lr = 0.5 * problem.max_stable_lr()
    w0, d = 0.1 * torch.randn(p, 3, generator=gen), 0.1 * torch.randn(p, 3, generator=gen)
    z, y = ((raw - mean) / std).double(), problem.y.double()
    w = w0.double()
    for _ in range(200):
        w = w - lr * (z.T @ (z @ w - y) / n + d.double())
    np.testing.assert_allclose(problem.gradient_descent(w0, 200, lr, d).double().numpy(), w.numpy(), atol=1e-5 * float(w.abs().max()))
    np.testing.assert_allclose(problem.gradient(w0.float()).double().numpy(), (z.T @ (z @ w0.double() - y) / n).numpy(), atol=1e-5)


def test_standardisation_by_aggregated_moments_equals_centralised():
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randn(n, 40, generator=gen) * 3 + 2).half() for n in (5, 17, 33)]
    parts[0][:, 7] = parts[1][:, 7] = parts[2][:, 7] = 0.5  # a constant feature
    moments = [feature_moments(p) for p in parts]
    mean, std = standardization(sum(m[0] for m in moments), sum(m[1] for m in moments), sum(m[2] for m in moments))
    pooled = torch.cat(parts).double().numpy()
    np.testing.assert_allclose(mean.numpy(), pooled.mean(0), rtol=1e-6, atol=1e-6)
    expected_std = pooled.std(0)
    expected_std[7] = 1.0  # constant: divided by 1, so it standardises to 0
    np.testing.assert_allclose(std.numpy(), expected_std, rtol=1e-5)


def test_scaffold_stage_two_separates_a_tiny_problem():
    """Three clients, one class each (the hardest split), more features than samples: SCAFFOLD
    rounds with M local GD steps reach 100% training accuracy on every client."""
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(3, 60, generator=gen)
    clients = []
    for label in range(3):
        raw = centres[label] + 0.5 * torch.randn(20, 60, generator=gen)
        clients.append((raw, torch.full((20,), label)))
    moments = [feature_moments(raw) for raw, _ in clients]
    mean, std = standardization(*(sum(m[i] for m in moments) for i in range(3)))
    problems = [LocalLeastSquares(FeatureMatrix(raw, mean, std), one_hot_targets(y, 3, False)) for raw, y in clients]
    lr = 0.5 * min(p.max_stable_lr() for p in problems)
    w, c = torch.zeros(60, 3), torch.zeros(60, 3)
    c_i = [torch.zeros(60, 3) for _ in problems]
    for _ in range(30):
        deltas, changes = [], []
        for k, problem in enumerate(problems):
            end = problem.gradient_descent(w, 100, lr, c - c_i[k])
            new = control_update({"W": c_i[k]}, {"W": c}, {"W": w}, {"W": end}, 100, lr)["W"]
            deltas.append({"W": end - w})
            changes.append(new - c_i[k])
            c_i[k] = new
        w = apply_deltas({"W": w}, deltas, [1.0] * 3, 1.0)["W"]
        c = c + sum(changes) / 3
    accuracies = [p.loss_and_accuracy(w)[1] for p in problems]
    assert accuracies == [1.0, 1.0, 1.0]


def test_tct_run_keeps_features_on_the_clients_and_uses_one_coordinate_subset(tmp_path):
    cfg, grid, experiment, summary = _run(tmp_path)
    assert summary["global_accuracy"] is not None and summary["tct_features"] == P
    fed = build_federated_data(cfg.data, int(cfg.seed))
    sizes = {len(idx) for idx in fed.client_train}
    num_classes = int(fed.bundle.num_classes)
    model_shapes = {tuple(v.shape) for v in build_model("digits_mlp", (1, 8, 8), 10).state_dict().values()}
    for msg in grid.replies:  # message inspection: no feature row and no raw sample ever leaves a client
        if msg.has_error():
            continue
        for record in msg.content.array_records.values():
            for array in record.values():
                shape = tuple(array.shape)
                assert shape in model_shapes | {(P,), (P, num_classes)}, (msg.metadata.message_type, shape)
                assert not set(shape) & sizes, "an array with one entry per sample left a client"
        if msg.metadata.message_type == "query.entk":
            assert ARRAYS not in msg.content and set(msg.content[MOMENTS]) == {"sum", "sum_squares"}
    # stage 2 sent W (p x C) and the standardisation once per client
    stage2 = [m for m in grid.sent if m.metadata.message_type == "train" and m.content["config"]["tct-stage"] == "linear"]
    assert stage2 and all(tuple(m.content[ARRAYS][WEIGHTS].shape) == (P, num_classes) for m in stage2)
    assert sum(STANDARDIZATION in m.content for m in stage2) == 4
    # every client's stored rows are its samples' eNTK features at the seed's coordinates,
    # and the server's standardisation is the pooled one
    stage1_model = [m for m in grid.sent if m.metadata.message_type == "query.entk"][0].content[ARRAYS]
    model = build_model("digits_mlp", (1, 8, 8), 10)
    model.load_state_dict(stage1_model.to_torch_state_dict())
    net, coords = entk_setup(model, int(cfg.tct.features), int(cfg.seed))
    pooled = []
    for pid, node in enumerate(grid.node_ids):
        meta = grid.contexts[node].state[f"tct/{FEATURES}"]
        stored = open_feature_file(Path(meta["path"]), dtype=torch.float16)
        x = torch.as_tensor(fed.bundle.train.x[fed.client_train[pid][:3]])
        expected = entk_features(net, x, coords, method="loop")
        np.testing.assert_allclose(stored[:3].float().numpy(), expected.half().float().numpy(), atol=1e-3)
        pooled.append(stored.double())
    pooled = torch.cat(pooled)
    std = experiment.strategy.standardization
    np.testing.assert_allclose(std["mean"].numpy(), pooled.mean(0).numpy(), rtol=1e-4, atol=1e-6)


def test_tct_variants_run(tmp_path):
    """TCT-FedAvg, TCT-GD, no normalisation and T1 = 0, compared in one run."""
    extra = ('compare=["label=tct-fedavg tct.solver=fedavg","label=tct-gd tct.solver=gd tct.lr=0.01",'
             '"label=won tct.normalize=false tct.lr=0.2","label=t1-0 tct.stage1_rounds=0"]')
    overrides = _overrides(tmp_path, extra)
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    runs = summary["comparison"]
    assert set(runs) == {"tct", "tct-fedavg", "tct-gd", "won", "t1-0"}
    for label, run in runs.items():
        assert run["global_accuracy"] is not None and run["global_accuracy"] > 0.3, label
    t1_zero = json.loads((Path(runs["t1-0"]["out_dir"]) / "summary.json").read_text())
    assert t1_zero["tct_stage1_rounds"] == 0 and "tct_stage1_global_accuracy" not in t1_zero


@pytest.mark.parametrize("override, key", [("tct.stage1_rounds=6", "tct.stage1_rounds"),
                                           ("tct.features=100000", "tct.features"),
                                           ("tct.solver=adam", "tct.solver"),
                                           ("tct.feature_dtype=int8", "tct.feature_dtype")])
def test_tct_config_errors_name_their_key(tmp_path, override, key):
    from flower_app.run.config import validate_with_data

    with pytest.raises(ConfigError, match=key):
        validate_with_data(load_config("quickstart", _overrides(tmp_path, override).split()))


def test_server_test_features_use_the_stage_one_model(tmp_path):
    _, grid, experiment, _ = _run(tmp_path, "rounds=3")
    assert isinstance(experiment.arrays, ArrayRecord) and set(experiment.arrays) == {WEIGHTS}
    assert experiment.strategy.test.shape[1] == P


def test_a_gram_matrix_beyond_the_machine_memory_is_refused_before_round_one(tmp_path, monkeypatch):
    import task.tct.memory as memory

    monkeypatch.setattr(memory, "physical_memory", lambda: 1 << 20)
    overrides = _overrides(tmp_path)
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    with pytest.raises(ConfigError, match="tct.features"):
        Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert not [m for m in grid.sent if m.metadata.message_type == "train"]
