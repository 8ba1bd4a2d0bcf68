"""LocalUpdate(α, γ, Θ, ServerOpt) on the paper's quadratic federation, run through the real
ServerApp and ClientApp: Theorem 1 (the averaged client update is ∇f̃), Theorem 2 (MAML is
Θ_{2K+1}), convergence to x*(α, γ, Θ) rather than x*, the Table 2 rates of the server
optimizers, and the server optimizers' arithmetic."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from flower_app.run.config import load_config
from flower_app.app.server_app import Experiment
from strategies.common import ARRAYS, METRICS, NUM_EXAMPLES
from strategies.local_update import LocalUpdateAdam, LocalUpdateGD, LocalUpdateNesterov, make_strategy
from task.analysis.surrogate import (QuadraticFederation, Theta, kappa, rate, surrogate_gradient, surrogate_hessian,
                            surrogate_minimizer, tuned_server)
from tests.local_grid import LocalGrid

CLIENTS, D = 5, 4
QUADRATIC = ("wandb.enabled=false compare=[] algorithm=local_update model.name=quadratic "
             f"data.name=synthetic_quadratic data.partition=natural data.num_clients={CLIENTS} data.quadratic.d={D} "
             f"data.quadratic.mu=1.0 data.quadratic.L=10.0 data.quadratic.C=1.0 train.fraction=1.0 train.batch_size={D} "
             "eval.every=1000 eval.final_window=1")
WEIGHT = "fc1.1.weight"


def _experiment(tmp_path, overrides: str, rounds: int):
    overrides = f"{QUADRATIC} rounds={rounds} out_dir={tmp_path / 'out'} {overrides}"
    cfg = load_config("quickstart", overrides.split())
    experiment = Experiment(LocalGrid(CLIENTS, {"experiment": "quickstart", "overrides": overrides}), cfg)
    fed = QuadraticFederation(experiment.data.bundle.meta["A"], experiment.data.bundle.meta["c"])
    return experiment, fed


def _x(arrays: ArrayRecord) -> np.ndarray:
    return arrays.to_torch_state_dict()[WEIGHT].double().numpy().ravel()


def _trajectory(experiment) -> list[np.ndarray]:
    """x_0 and the model after every round (recorded at the server's aggregation)."""
    xs = [_x(experiment.arrays)]
    experiment.save_checkpoint = lambda t, fed: xs.append(_x(experiment.arrays))  # the model after each round
    experiment.run()
    return xs


@pytest.mark.parametrize("overrides, alpha, gamma, theta", [
    ("local_update.preset=fedavg local_update.steps=6 local_update.client_lr=0.05", 0.0, 0.05, Theta.prefix(6)),
    ("local_update.preset=fomaml local_update.steps=6 local_update.client_lr=0.05", 0.0, 0.05, Theta.last(6)),
    ("local_update.preset=fedprox local_update.steps=6 local_update.client_lr=0.05 local_update.alpha=2.0",
     2.0, 0.05, Theta.prefix(6)),
    ("local_update.preset=fedsgd local_update.steps=6 local_update.client_lr=0", 0.0, 0.0, Theta.prefix(6)),
    ("local_update.preset=minibatch_sgd local_update.client_lr=0.05", 0.0, 0.05, Theta.last(1)),
    ("local_update.preset=custom local_update.theta=[0.5,0,2,1] local_update.client_lr=0.05 local_update.alpha=0.3",
     0.3, 0.05, Theta.of([0.5, 0, 2, 1])),
])
def test_averaged_client_update_is_the_surrogate_gradient(tmp_path, overrides, alpha, gamma, theta):
    """Theorem 1 with full participation and full-batch clients: q_t = ∇f̃(x_t, α, γ, Θ)."""
    experiment, fed = _experiment(tmp_path, overrides, rounds=1)
    x0 = _x(experiment.arrays)
    experiment.run()
    q = experiment.strategy.pseudo_gradient[WEIGHT].ravel()
    expected = surrogate_gradient(fed, x0, alpha, gamma, theta)
    np.testing.assert_allclose(q, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
    if theta.K > 1 and gamma > 0:  # distorted: not the gradient of f
        plain = surrogate_gradient(fed, x0, 0.0, 0.0, Theta.last(1)) * theta.total()
        assert np.abs(q - plain).max() > 1e-2 * np.abs(plain).max()


def test_maml_client_equals_local_update_with_theta_2k_plus_1(tmp_path):
    """Theorem 2: K gradient-descent steps of MAML send ∇f̃_i(x, 0, γ, Θ_{2K+1})."""
    K, gamma = 3, 0.04
    common = f"local_update.client_lr={gamma}"
    maml, fed = _experiment(tmp_path / "maml", f"local_update.preset=maml local_update.steps={K} {common}", rounds=1)
    x0_maml = _x(maml.arrays)
    maml.run()
    theta = "[" + ",".join(["0"] * (2 * K) + ["1"]) + "]"
    lu, _ = _experiment(tmp_path / "lu", f"local_update.preset=custom local_update.theta={theta} {common}", rounds=1)
    x0 = _x(lu.arrays)
    np.testing.assert_array_equal(x0, x0_maml)
    lu.run()
    q_maml = maml.strategy.pseudo_gradient[WEIGHT].ravel()
    q_lu = lu.strategy.pseudo_gradient[WEIGHT].ravel()
    expected = surrogate_gradient(fed, x0, 0.0, gamma, Theta.last(2 * K + 1))
    np.testing.assert_allclose(q_lu, expected, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(q_maml, expected, rtol=2e-5, atol=1e-5)


def test_local_update_converges_to_the_surrogate_minimizer_not_to_x_star(tmp_path):
    gamma, K = 0.05, 8
    theta = Theta.prefix(K)
    experiment, fed = _experiment(tmp_path / "probe", f"local_update.steps={K} local_update.client_lr={gamma}", rounds=1)
    H = surrogate_hessian(fed, 0.0, gamma, theta)
    lam = np.linalg.eigvalsh(H)
    lr, _ = tuned_server(lam[0], lam[-1], "none")
    experiment, _ = _experiment(tmp_path, f"local_update.steps={K} local_update.client_lr={gamma} server_opt.lr={lr}",
                                rounds=60)
    experiment.run()
    x_final = _x(experiment.arrays)
    x_tilde, x_star = surrogate_minimizer(fed, 0.0, gamma, theta), fed.minimizer()
    gap = np.linalg.norm(x_tilde - x_star)
    assert gap > 0.05 * np.linalg.norm(x_star)  # the two minimisers differ here ...
    assert np.linalg.norm(x_final - x_tilde) < 1e-3 * gap  # ... and LocalUpdate finds x*(α, γ, Θ)
    assert np.linalg.norm(x_final - x_star) > 0.9 * gap


@pytest.mark.parametrize("momentum, server_opt", [("none", "none"), ("heavy_ball", "heavy_ball"),
                                                  ("nesterov", "nesterov")])
def test_observed_rate_respects_table_2(tmp_path, momentum, server_opt):
    """Server GD / heavy-ball / Nesterov tuned for the surrogate (Lessard et al.): the observed
    linear rate towards x*(α, γ, Θ) is at most ρ(κ) of Table 2, and close to it (the A_i share
    eigenvectors, so cond(f̃) = κ and the bound is tight)."""
    gamma, K, shared = 0.01, 5, "data.quadratic.shared_basis=true"
    theta = Theta.prefix(K)
    probe, fed = _experiment(tmp_path / "probe", shared, rounds=1)
    lam = np.linalg.eigvalsh(surrogate_hessian(fed, 0.0, gamma, theta))
    k = kappa(fed, 0.0, gamma, theta)
    assert lam[-1] / lam[0] == pytest.approx(k, rel=1e-9)
    lr, beta = tuned_server(lam[0], lam[-1], momentum)
    rho = rate(k, momentum)
    rounds = int(np.ceil(np.log(1e-4) / np.log(rho)))
    experiment, _ = _experiment(tmp_path / momentum, f"{shared} local_update.steps={K} local_update.client_lr={gamma} "
                                f"server_opt.name={server_opt} server_opt.lr={lr} server_opt.momentum={beta}", rounds)
    xs = _trajectory(experiment)
    x_tilde = surrogate_minimizer(fed, 0.0, gamma, theta)
    errors = np.array([np.linalg.norm(x - x_tilde) for x in xs])
    if momentum != "none":  # tuned momentum has a double root of modulus ρ: error C·t·ρ^t
        errors = errors / np.arange(1, len(errors) + 1)
    half = rounds // 2
    observed = (errors[-1] / errors[half]) ** (1.0 / (rounds - half))
    assert 0.8 * rho <= observed <= rho * 1.02, (observed, rho)
    assert errors[-1] < 1e-3 * errors[0]


def _reply(node: int, grads: dict, examples: int) -> Message:
    content = RecordDict({ARRAYS: ArrayRecord({k: torch.tensor(v) for k, v in grads.items()}),
                          METRICS: MetricRecord({NUM_EXAMPLES: float(examples), "train_loss": 1.0})})
    msg = Message(content, dst_node_id=node, message_type="train")
    msg.metadata.__dict__["_src_node_id"] = node
    return msg


def _round(strategy, x: np.ndarray, grads: list[np.ndarray], examples=(1, 3)) -> np.ndarray:
    arrays = ArrayRecord({"w": torch.tensor(x)})
    strategy._sent = arrays
    if isinstance(strategy, LocalUpdateGD) and strategy.current_arrays is None:
        strategy.current_arrays = arrays
    replies = [_reply(i + 1, {"w": g}, n) for i, (g, n) in enumerate(zip(grads, examples))]
    out, _ = strategy.aggregate_train(1, replies)
    return out["w"].numpy()


def test_server_optimizers_step_on_the_averaged_pseudo_gradient():
    x = np.array([1.0, -2.0])
    g1, g2 = np.array([2.0, 0.0]), np.array([0.0, 4.0])
    q = (g1 + g2) / 2
    np.testing.assert_allclose(_round(LocalUpdateGD(0.5, 0.0, "uniform"), x, [g1, g2]), x - 0.5 * q, rtol=1e-6)
    weighted = (1 * g1 + 3 * g2) / 4
    np.testing.assert_allclose(_round(LocalUpdateGD(0.5, 0.0, "examples"), x, [g1, g2]), x - 0.5 * weighted, rtol=1e-6)
    # heavy-ball (Flower's FedAvgM): v1 = q, v2 = βq + q
    hb = LocalUpdateGD(0.1, 0.9, "uniform")
    x1 = _round(hb, x, [g1, g2])
    x2 = _round(hb, x1, [g1, g2])
    np.testing.assert_allclose(x1, x - 0.1 * q, rtol=1e-6)
    np.testing.assert_allclose(x2, x1 - 0.1 * 1.9 * q, rtol=1e-6)
    # Nesterov: x ← x − η(q + βv), v ← βv + q
    nag = LocalUpdateNesterov(0.1, 0.9, "uniform")
    y1 = _round(nag, x, [g1, g2])
    y2 = _round(nag, y1, [g1, g2])
    np.testing.assert_allclose(y1, x - 0.1 * (q + 0.9 * q), rtol=1e-6)
    np.testing.assert_allclose(y2, y1 - 0.1 * (q + 0.9 * 1.9 * q), rtol=1e-6)
    # Adam with bias correction: the first step is η·q/(|q| + ε) whatever β₁, β₂
    adam = LocalUpdateAdam(0.01, 0.9, 0.99, 1e-8, "uniform")
    z1 = _round(adam, x, [g1, g2])
    np.testing.assert_allclose(z1, x - 0.01 * np.sign(q), rtol=1e-6)
    z2 = _round(adam, z1, [2 * g1, 2 * g2])
    m = 0.9 * 0.1 * q + 0.1 * 2 * q
    v = 0.99 * 0.01 * q**2 + 0.01 * 4 * q**2
    np.testing.assert_allclose(z2, z1 - 0.01 * (m / (1 - 0.81)) / (np.sqrt(v / (1 - 0.99**2)) + 1e-8), rtol=1e-6)


def test_make_strategy_picks_the_configured_server_optimizer():
    for name, cls in (("none", LocalUpdateGD), ("heavy_ball", LocalUpdateGD), ("nesterov", LocalUpdateNesterov),
                      ("adam", LocalUpdateAdam)):
        cfg = load_config("quickstart", ["algorithm=local_update", f"server_opt.name={name}"])
        strategy = make_strategy(cfg)
        assert isinstance(strategy, cls)
    assert make_strategy(load_config("quickstart", ["algorithm=local_update"])).server_momentum == 0.0


@pytest.mark.parametrize("server_opt", ["none", "heavy_ball", "nesterov", "adam"])
def test_local_update_trains_a_network(tmp_path, server_opt):
    """Every server optimizer end to end on the bundled digits with an MLP (and MAML once)."""
    overrides = (f"wandb.enabled=false compare=[] algorithm=local_update rounds=3 out_dir={tmp_path / 'o'} "
                 f"data.num_clients=4 train.fraction=1.0 train.batch_size=16 local_update.steps=5 "
                 f"local_update.client_lr=0.1 server_opt.name={server_opt} "
                 f"server_opt.lr={0.01 if server_opt == 'adam' else 0.1} eval.final_window=1")
    if server_opt == "adam":
        overrides += " local_update.preset=maml"
    cfg = load_config("quickstart", overrides.split())
    experiment = Experiment(LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}), cfg)
    summary = experiment.run()
    losses = [r["personalized_loss"] for r in experiment.recorder.records if r["phase"] == "eval"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], (summary, losses)
