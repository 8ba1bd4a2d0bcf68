"""FedALA: W's step is the clipped autograd gradient step of the loss of θ̂, θ̂ is composed as
θ + (Θ − θ) ⊙ W on the top tensors and Θ elsewhere, the start phase runs until the losses settle,
a client sends only its trained model (W never crosses the wire), and bad values are refused by key."""

import numpy as np
import pytest
import torch

from flower_app.run.config import load_config, validate_with_data
from strategies import fedala
from strategies.common import ARRAYS
from strategies.state_store import keep_arrays, kept_arrays
from task.errors import ConfigError
from tests.privacy import fingerprint
from tests.test_fedrep import make_runtime
from tests.test_personal_models import ONE_FULL_BATCH_STEP, loss_at, message, objective_step, params, perturbed, run_recorded

WHOLE_DATA = ["fedala.rand_percent=100", "train.batch_size=40"]  # W learns on one full batch of all 40 examples
TOP = ["fc2.weight", "fc2.bias"]  # layer_idx=2 on digits_mlp: the last layer


def mixed(local, received, weights):
    """θ̂ by hand: Θ everywhere, θ + (Θ − θ) ⊙ W on the weighted keys."""
    return {k: (local[k] + (received[k] - local[k]) * weights[k]) if k in weights else received[k] for k in received}


def weight_step(rt, local, received, weights, eta):
    """clip(W − η ∇_W L(θ̂(W)), 0, 1), the gradient by autograd w.r.t. W itself; and the loss."""
    leaves = {k: w.clone().requires_grad_(True) for k, w in weights.items()}
    loss = loss_at(rt, mixed(local, received, leaves))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {k: torch.clamp(weights[k] - eta * g, 0.0, 1.0) for k, g in zip(leaves, grads)}, float(loss.detach())


def client_with_history(overrides, kept_weights=True, seed=1):
    """A runtime holding a kept θ_i (and, unless told otherwise, a kept W in (0, 1)); Θ to send it."""
    rt = make_runtime("fedala", [*WHOLE_DATA, *overrides])
    received, local = params(rt.model), perturbed(rt, 0.5, seed)
    keep_arrays(rt, fedala.LOCAL, {**rt.model.state_dict(), **local})
    g = torch.Generator().manual_seed(seed + 100)
    weights = {k: torch.rand(received[k].shape, generator=g) for k in TOP}
    if kept_weights:
        keep_arrays(rt, fedala.WEIGHTS, weights)
    return rt, received, local, weights


def test_the_top_tensors_are_the_last_layer_idx_parameters():
    rt = make_runtime("fedala")
    assert fedala.top_keys(rt.model, 2) == TOP
    assert fedala.top_keys(rt.model, 3) == ["fc1.1.bias", *TOP]
    assert fedala.top_keys(rt.model, 0) == [k for k, _ in rt.model.named_parameters()]


def test_a_weight_step_is_the_clipped_gradient_step_and_theta_hat_is_composed_from_it():
    eta = 40.0  # large enough that the clip acts at both ends
    rt, received, local, weights = client_with_history([f"fedala.eta={eta}"])
    rt.load(message(rt, received)[ARRAYS])
    got, epochs = fedala.adapt(rt, 1, fedala.ALA_SALT)
    want, _ = weight_step(rt, local, received, weights, eta)
    assert epochs == 1  # W kept: one pass (of one batch)
    for k in TOP:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    flat = torch.cat([want[k].flatten() for k in TOP])
    assert (flat == 0).any() and (flat == 1).any() and ((flat > 0) & (flat < 1)).any()  # the clip matters
    # by hand: the top layer mixes θ and Θ element-wise; fc1 is Θ's, whatever θ's fc1 was
    state = rt.model.state_dict()
    for k, v in mixed(local, received, want).items():
        torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-6)
    w = want["fc2.bias"]
    torch.testing.assert_close(state["fc2.bias"], (1 - w) * local["fc2.bias"] + w * received["fc2.bias"])
    assert torch.equal(state["fc1.1.weight"], received["fc1.1.weight"]) and not torch.equal(local["fc1.1.weight"], received["fc1.1.weight"])


def test_one_training_round_is_the_weight_step_then_the_local_step_from_theta_hat():
    rt, received, local, weights = client_with_history([*ONE_FULL_BATCH_STEP, "fedala.eta=0.5"])
    sent = fedala.train_fedala(rt, message(rt, received))
    new_w, _ = weight_step(rt, local, received, weights, 0.5)
    want = objective_step(rt, mixed(local, received, new_w), lambda x: loss_at(rt, x), float(rt.cfg.train.lr))
    kept_w, kept_model = kept_arrays(rt, fedala.WEIGHTS), kept_arrays(rt, fedala.LOCAL)
    for k in want:
        got = torch.as_tensor(sent[ARRAYS][k].numpy())
        torch.testing.assert_close(got, want[k], rtol=1e-5, atol=1e-6)
        assert torch.equal(kept_model[k], got)  # θ_i kept is θ_i sent
    for k in TOP:
        torch.testing.assert_close(kept_w[k], new_w[k], rtol=1e-5, atol=1e-6)
    assert set(sent[ARRAYS].keys()) == set(rt.model.state_dict())
    assert float(sent["metrics"]["ala_epochs"]) == 1


def test_the_start_phase_trains_w_from_ones_until_the_losses_settle():
    rt, received, local, _ = client_with_history(["fedala.eta=0.5", "fedala.num_pre_loss=4", "fedala.threshold=0.01"],
                                                 kept_weights=False)
    rt.load(message(rt, received)[ARRAYS])
    got, epochs = fedala.adapt(rt, 1, fedala.ALA_SALT)
    weights, losses = {k: torch.ones_like(received[k]) for k in TOP}, []
    while not (len(losses) > 4 and np.std(losses[-4:]) < 0.01):
        weights, loss = weight_step(rt, local, received, weights, 0.5)
        losses.append(loss)
    assert epochs == len(losses) > 5  # it ran past its window, so the rule was tested
    for k in TOP:
        torch.testing.assert_close(got[k], weights[k], rtol=1e-4, atol=1e-5)


def test_the_start_phase_stops_at_max_start_epochs():
    rt, received, _, _ = client_with_history(["fedala.threshold=0", "fedala.max_start_epochs=7"], kept_weights=False)
    rt.load(message(rt, received)[ARRAYS])
    assert fedala.adapt(rt, 1, fedala.ALA_SALT)[1] == 7  # std < 0 never holds


def test_the_subset_is_a_contiguous_slice_of_rand_percent_drawn_from_the_generator():
    rt = make_runtime("fedala", ["fedala.rand_percent=30"])
    starts = set()
    for r in range(1, 30):
        sub = fedala.ala_subset(rt, rt.generator(r, fedala.ALA_SALT))
        assert len(sub) == 12  # int(0.3 · 40)
        start = int(torch.nonzero((rt.train.x == sub.x[0]).flatten(1).all(1))[0])
        assert torch.equal(sub.x, rt.train.x[start:start + 12])
        starts.add(start)
    assert len(starts) > 5 and max(starts) <= 28


@pytest.mark.parametrize("start", ["received", "initial"])
def test_a_client_without_a_local_model(start):
    """received: trains Θ as is, no W. initial: its θ is the initial weights, the start phase from W = 1."""
    rt = make_runtime("fedala", [*ONE_FULL_BATCH_STEP, *WHOLE_DATA, f"fedala.start={start}", "fedala.eta=0.5",
                                 "fedala.threshold=0", "fedala.max_start_epochs=3"])
    initial, received = params(rt.model), perturbed(rt, 0.5, 3)
    sent = fedala.train_fedala(rt, message(rt, received))
    theta_hat, epochs = received, 0
    if start == "initial":
        weights, epochs = {k: torch.ones_like(received[k]) for k in TOP}, 3  # threshold 0: the bound stops it
        for _ in range(epochs):
            weights, _ = weight_step(rt, initial, received, weights, 0.5)
        theta_hat = mixed(initial, received, weights)
        for k in TOP:
            torch.testing.assert_close(kept_arrays(rt, fedala.WEIGHTS)[k], weights[k], rtol=1e-5, atol=1e-6)
    else:
        assert kept_arrays(rt, fedala.WEIGHTS) is None
    want = objective_step(rt, theta_hat, lambda x: loss_at(rt, x), float(rt.cfg.train.lr))
    for k in want:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)
    assert float(sent["metrics"]["ala_epochs"]) == epochs


def test_round_one_under_initial_skips_ala():
    rt = make_runtime("fedala", [*ONE_FULL_BATCH_STEP, "fedala.start=initial"])
    sent = fedala.train_fedala(rt, message(rt, params(rt.model)))
    assert kept_arrays(rt, fedala.WEIGHTS) is None and float(sent["metrics"]["ala_epochs"]) == 0


def test_evaluation_scores_theta_hat_built_from_the_received_model_and_keeps_nothing():
    rt, received, local, weights = client_with_history(["fedala.eta=0.5"])
    before = {name: kept_arrays(rt, name) for name in (fedala.LOCAL, fedala.WEIGHTS)}
    scores = fedala.evaluate_fedala(rt, message(rt, received, server_round=3))
    new_w, _ = weight_step(rt, local, received, weights, 0.5)
    rt.model.load_state_dict({**rt.model.state_dict(), **mixed(local, received, new_w)})
    assert scores["metrics"]["loss"] == pytest.approx(rt.evaluate_local()["loss"], rel=1e-5)
    rt.model.load_state_dict({**rt.model.state_dict(), **received})
    assert scores["metrics"]["loss"] != pytest.approx(rt.evaluate_local()["loss"], rel=1e-3)  # not Θ itself
    for name, arrays in before.items():
        assert all(torch.equal(arrays[k], kept_arrays(rt, name)[k]) for k in arrays)


def uploads(grid) -> list[dict[str, np.ndarray]]:
    return [{k: a.numpy() for k, a in m.content[ARRAYS].items()} for m in grid.replies if m.metadata.message_type == "train"]


def test_a_run_sends_whole_models_and_never_w_and_with_eta_zero_it_is_fedavg(tmp_path):
    grid = run_recorded("algorithm=fedala", tmp_path / "fedala")
    assert not any(m.has_error() for m in grid.replies)
    keys = set(make_runtime("fedala").model.state_dict())
    trains = [m for m in grid.replies if m.metadata.message_type == "train"]
    assert len(trains) == 12 and all(set(m.content[ARRAYS].keys()) == keys for m in trains)
    assert max(float(m.content["metrics"]["ala_epochs"]) for m in trains) > 10  # some client re-sampled: its start phase
    evals = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert evals and all(set(m.content[ARRAYS].keys()) == keys for m in evals)  # Θ goes down to be adapted
    assert not any(m.content.array_records for m in grid.replies if m.metadata.message_type == "evaluate")
    kept_w = {fingerprint(a.numpy()) for c in grid.contexts.values() for name, r in c.state.items()
              if name.endswith(fedala.WEIGHTS) for a in r.values()}
    on_wire = {fingerprint(a.numpy()) for m in [*grid.sent, *grid.replies] if not m.has_error()
               for r in m.content.array_records.values() for a in r.values()}
    assert kept_w and not kept_w & on_wire
    fedavg = uploads(run_recorded("algorithm=fedavg", tmp_path / "fedavg"))
    still = uploads(run_recorded("algorithm=fedala fedala.eta=0", tmp_path / "eta0"))  # W stays ones: θ̂ = Θ
    moved = uploads(grid)
    for a, b in zip(still, fedavg, strict=True):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(a[k], b[k], atol=1e-4) for a, b in zip(moved, fedavg) for k in a)


@pytest.mark.parametrize("override, key, allowed", [
    ("fedala.eta=-1", "fedala.eta", ">= 0"),
    ("fedala.rand_percent=0", "fedala.rand_percent", "positive"),
    ("algorithm=fedala fedala.rand_percent=101", "fedala.rand_percent", "1..100"),
    ("fedala.layer_idx=-1", "fedala.layer_idx", ">= 0"),
    ("fedala.threshold=-0.1", "fedala.threshold", ">= 0"),
    ("fedala.num_pre_loss=0", "fedala.num_pre_loss", "positive"),
    ("fedala.max_start_epochs=0", "fedala.max_start_epochs", "positive"),
    ("fedala.start=zero", "fedala.start", "initial"),
])
def test_a_bad_value_is_refused_naming_its_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", override.split())
    assert str(info.value).startswith(f"{key}:") and allowed in str(info.value)


def test_more_top_tensors_than_the_model_has_are_refused():
    with pytest.raises(ConfigError, match=r"^fedala\.layer_idx: got 5, but model digits_mlp has 4"):
        validate_with_data(load_config("quickstart", ["algorithm=fedala", "compare=[]", "fedala.layer_idx=5"]))
