"""SCAFFOLD: the server and client updates, the kept control variates, and convergence to the
global optimum of a heterogeneous convex problem where FedAvg with many local steps is biased."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from flower_app.run.config import load_config, load_variants
from flower_app.app.server_app import Experiment, run_variants
from strategies.common import ARRAYS, METRICS, NUM_EXAMPLES
from strategies.scaffold import CLIENT_CONTROL, CONTROL, Scaffold
from task.data.federated_data import build_federated_data
from tests.local_grid import LocalGrid

CONVEX = ("wandb.enabled=false compare=[] model.name=linear data.name=synthetic_linear data.partition=natural "
          "data.num_clients=4 data.synthetic.d=5 data.synthetic.k=2 data.synthetic.n_train=20 data.synthetic.noise=0.5 "
          "train.fraction=1.0 train.batch_size=20 train.local_steps=25 train.lr=0.05 train.momentum=0.0 "
          "train.weight_decay=0.0 eval.every=1000 eval.final_window=1")


def _reply(node: int, deltas: dict, controls: dict, examples: int) -> Message:
    content = RecordDict({ARRAYS: ArrayRecord({k: torch.tensor(v) for k, v in deltas.items()}),
                          CONTROL: ArrayRecord({k: torch.tensor(v) for k, v in controls.items()}),
                          METRICS: MetricRecord({NUM_EXAMPLES: float(examples), "train_loss": 1.0})})
    msg = Message(content, dst_node_id=node, message_type="train")
    msg.metadata.__dict__["_src_node_id"] = node
    return msg


@pytest.mark.parametrize("weighting, shares", [("uniform", (0.25, 0.25)), ("examples", (0.1, 0.3))])
def test_server_moves_x_by_the_mean_delta_and_c_by_the_population_share(weighting, shares):
    strategy = Scaffold(global_lr=0.5, weighting=weighting)
    strategy.observe_population({1: 10, 2: 30, 3: 40, 4: 20})
    strategy._sent = ArrayRecord({"w": torch.tensor([1.0, 1.0])})
    replies = [_reply(1, {"w": [2.0, 0.0]}, {"w": [4.0, 8.0]}, 10), _reply(2, {"w": [-2.0, 4.0]}, {"w": [0.0, 4.0]}, 30)]
    arrays, _ = strategy.aggregate_train(1, replies)
    s1, s2 = shares
    mean_delta = (s1 * np.array([2.0, 0.0]) + s2 * np.array([-2.0, 4.0])) / (s1 + s2)
    np.testing.assert_allclose(arrays["w"].numpy(), 1.0 + 0.5 * mean_delta, rtol=1e-6)
    np.testing.assert_allclose(strategy.control["w"].numpy(), s1 * np.array([4.0, 8.0]) + s2 * np.array([0.0, 4.0]),
                               rtol=1e-6)


def _least_squares_optimum(cfg) -> np.ndarray:
    fed = build_federated_data(cfg.data, int(cfg.seed))
    idx = np.concatenate(fed.client_train)
    x = fed.bundle.train.x[idx].reshape(len(idx), -1).astype(np.float64)
    y = fed.bundle.train.y[idx].astype(np.float64)
    design = np.hstack([x, np.ones((len(x), 1))])
    return np.linalg.lstsq(design, y, rcond=None)[0]


def _final_weights(tmp_path, algorithm: str, rounds: int):
    overrides = f"{CONVEX} algorithm={algorithm} rounds={rounds} out_dir={tmp_path / algorithm}"
    cfg = load_config("quickstart", overrides.split())
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, cfg)
    experiment.run()
    state = experiment.arrays.to_torch_state_dict()
    theta = np.concatenate([state["fc1.1.weight"].double().numpy().ravel(), state["fc1.1.bias"].double().numpy()])
    return cfg, theta, grid, experiment


def test_scaffold_reaches_the_global_optimum_where_fedavg_is_biased(tmp_path):
    cfg, scaffold, grid, experiment = _final_weights(tmp_path, "scaffold", 150)
    _, fedavg, _, _ = _final_weights(tmp_path, "fedavg", 150)
    optimum = _least_squares_optimum(cfg)
    scale = np.linalg.norm(optimum)
    assert np.linalg.norm(scaffold - optimum) / scale < 1e-4
    assert np.linalg.norm(fedavg - optimum) / scale > 1e-2  # the biased fixed point of 25 local steps
    # c_i kept on every node, and the server's c is their average (full participation, uniform)
    kept = []
    for context in grid.contexts.values():
        assert f"scaffold/{CLIENT_CONTROL}" in context.state
        kept.append(context.state[f"scaffold/{CLIENT_CONTROL}"].to_torch_state_dict()["fc1.1.weight"])
    np.testing.assert_allclose(experiment.strategy.control["fc1.1.weight"].numpy(),
                               torch.stack(kept).mean(0).numpy(), rtol=1e-5, atol=1e-7)


def test_one_full_batch_step_sets_c_i_to_the_local_gradient(tmp_path):
    overrides = f"{CONVEX} algorithm=scaffold rounds=1 train.local_steps=1 out_dir={tmp_path}"
    cfg = load_config("quickstart", overrides.split())
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, cfg)
    start = experiment.arrays.to_torch_state_dict()
    experiment.run()
    fed = build_federated_data(cfg.data, int(cfg.seed))
    for pid, node in enumerate(grid.node_ids):
        idx = fed.client_train[pid]
        x = torch.as_tensor(fed.bundle.train.x[idx]).reshape(len(idx), -1).double()
        y = torch.as_tensor(fed.bundle.train.y[idx]).double()
        w, b = start["fc1.1.weight"].double().requires_grad_(), start["fc1.1.bias"].double().requires_grad_()
        loss = torch.mean((x @ w.T + b - y[:, None]).squeeze(-1) ** 2)
        gw, gb = torch.autograd.grad(loss, (w, b))
        # c = c_i = 0 in round 1, one step: c_i+ = (x - y)/lr = the full-batch gradient at x
        kept = grid.contexts[node].state[f"scaffold/{CLIENT_CONTROL}"].to_torch_state_dict()
        np.testing.assert_allclose(kept["fc1.1.weight"].double().numpy(), gw.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(kept["fc1.1.bias"].double().numpy(), gb.numpy(), rtol=1e-4, atol=1e-6)


def test_scaffold_with_finetuning_runs_end_to_end(tmp_path):
    overrides = (f"wandb.enabled=false out_dir={tmp_path} algorithm=scaffold compare=[] rounds=3 "
                 "finetune.enabled=true finetune.epochs=2 client_state.disk_above_bytes=0")
    grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    assert summary["finetune_accuracy_after"] is not None and summary["global_accuracy"] is not None
    # c_i of the large-state path lives on disk; every reply carries Δy and Δc_i of all parameters
    replies = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert replies and all(set(r.content[CONTROL]) == set(r.content[ARRAYS]) for r in replies)
    node = replies[0].metadata.src_node_id
    assert "path" in grid.contexts[node].state[f"scaffold/{CLIENT_CONTROL}"]
