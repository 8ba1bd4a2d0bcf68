"""Ditto, APFL and L2GD: one client step is a gradient step of the method's full objective
(autograd on the same batch), what each client sends, and bad values refused by key."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch.func import functional_call

from flower_app.run.config import load_config
from strategies import ALGORITHMS, apfl, ditto, l2gd
from strategies.common import ARRAYS, CONFIG
from strategies.state_store import keep_arrays, kept_arrays
from task.errors import ConfigError
from task.learning.engine import loss_function
from tests.local_grid import LocalGrid
from tests.test_fedrep import make_runtime

ONE_FULL_BATCH_STEP = ["train.momentum=0", "train.weight_decay=0", "train.local_steps=1", "train.batch_size=40"]
BASE = "wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 rounds=4 eval.every=2 eval.final_window=1"


def run_recorded(overrides: str, tmp_path) -> LocalGrid:
    """A short quickstart run of 6 nodes through the real ServerApp/ClientApp; its grid (every message)."""
    from flower_app.app.server_app import Experiment
    from flower_app.run.config import load_config

    overrides = f"{BASE} {overrides} out_dir={tmp_path}"
    grid = LocalGrid(6, {"experiment": "quickstart", "overrides": overrides})
    assert Experiment(grid, load_config("quickstart", overrides.split())).run()["status"] == "completed"
    return grid


def params(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def message(rt, arrays: dict[str, torch.Tensor], server_round=1, **config) -> RecordDict:
    return RecordDict({ARRAYS: ArrayRecord({k: v.clone() for k, v in arrays.items()}),
                       CONFIG: ConfigRecord({"server-round": server_round, "variant": rt.cfg.label, **config})})


def objective_step(rt, start: dict[str, torch.Tensor], objective, lr: float) -> dict[str, torch.Tensor]:
    """start − lr · ∇objective(start), by autograd."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    grads = torch.autograd.grad(objective(leaves), list(leaves.values()))
    return {k: start[k] - lr * g for k, g in zip(leaves, grads)}


def loss_at(rt, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """f_i on the client's whole training set (the one full batch of these steps)."""
    return loss_function(False)(functional_call(rt.model, weights, (rt.train.x,)), rt.train.y)


def perturbed(rt, scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in params(rt.model).items()}


@pytest.mark.parametrize("pull", ["gradient", "after_momentum"])
def test_a_ditto_personal_step_descends_loss_plus_the_pull_toward_the_received_model(pull):
    rt = make_runtime("ditto", [*ONE_FULL_BATCH_STEP, "ditto.lam=0.7", f"ditto.pull={pull}"])
    w, v = params(rt.model), perturbed(rt, 0.3, 1)
    keep_arrays(rt, ditto.PERSONAL, {**rt.model.state_dict(), **v})
    sent = ditto.train_ditto(rt, message(rt, w))
    lr, lam = float(rt.cfg.train.lr), 0.7
    want_v = objective_step(rt, v, lambda x: loss_at(rt, x) + lam / 2 * sum(((x[k] - w[k]) ** 2).sum() for k in x), lr)
    want_w = objective_step(rt, w, lambda x: loss_at(rt, x), lr)
    got_v = kept_arrays(rt, ditto.PERSONAL)
    for k in want_v:
        torch.testing.assert_close(got_v[k], want_v[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want_w[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adaptive", [False, True])
def test_an_apfl_step_descends_the_loss_of_the_mixture_and_of_the_global_model(adaptive):
    rt = make_runtime("apfl", [*ONE_FULL_BATCH_STEP, "apfl.alpha=0.6", f"apfl.adaptive={adaptive}"])
    w, v = params(rt.model), perturbed(rt, 0.3, 2)
    keep_arrays(rt, apfl.PERSONAL, {**rt.model.state_dict(), **v})
    sent = apfl.train_apfl(rt, message(rt, w))
    lr = float(rt.cfg.train.lr)
    both = {**{f"v.{k}": t for k, t in v.items()}, "alpha": torch.tensor(0.6)}

    def mixture_loss(x):
        return loss_at(rt, {k: x["alpha"] * x[f"v.{k}"] + (1 - x["alpha"]) * w[k] for k in w})

    want = objective_step(rt, both, mixture_loss, lr)
    got_v = kept_arrays(rt, apfl.PERSONAL)
    for k in v:
        torch.testing.assert_close(got_v[k], want[f"v.{k}"], rtol=1e-5, atol=1e-6)
    want_w = objective_step(rt, w, lambda x: loss_at(rt, x), lr)
    for k in w:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want_w[k], rtol=1e-5, atol=1e-6)
    assert "alpha" not in sent["metrics"]  # α stays on the client unless apfl.report_alpha
    assert abs(float(want["alpha"]) - 0.6) > 1e-4  # the step moves α: the adaptive check can fail
    kept = kept_arrays(rt, apfl.MIXING_WEIGHT)
    assert (kept is not None) == adaptive
    alpha = float(kept["alpha"]) if adaptive else apfl.mixing_weight(rt)
    assert alpha == pytest.approx(float(want["alpha"]) if adaptive else 0.6, abs=1e-6)


def test_apfl_reports_alpha_only_when_asked():
    rt = make_runtime("apfl", [*ONE_FULL_BATCH_STEP, "apfl.alpha=0.6", "apfl.adaptive=true", "apfl.report_alpha=true"])
    sent = apfl.train_apfl(rt, message(rt, params(rt.model)))
    assert float(sent["metrics"]["alpha"]) == pytest.approx(float(kept_arrays(rt, apfl.MIXING_WEIGHT)["alpha"]))


def test_apfl_evaluates_the_mixture_of_its_own_model_and_the_received_one():
    rt = make_runtime("apfl", ["apfl.alpha=0.25"])
    w, v = params(rt.model), perturbed(rt, 1.0, 3)
    keep_arrays(rt, apfl.PERSONAL, {**rt.model.state_dict(), **v})
    scores = apfl.evaluate_mixture(rt, message(rt, w))
    rt.model.load_state_dict({k: 0.25 * v[k] + 0.75 * w[k] for k in w})
    assert scores["metrics"]["loss"] == pytest.approx(rt.evaluate_local()["loss"], rel=1e-6)


def test_the_official_apfl_step_mixes_with_alpha_twice_and_shares_one_momentum():
    """LocalUpdateAPFL: w steps on f(w); u = αv + αw_before steps on α·f(u) with the same momentum
    buffer; v moves by u's step. Two full-batch steps at momentum 0.5, written out by hand."""
    rt = make_runtime("apfl", ["train.momentum=0.5", "train.weight_decay=0", "train.local_steps=2",
                               "train.batch_size=40", "apfl.alpha=0.6", "apfl.variant=official"])
    w, v = params(rt.model), perturbed(rt, 0.3, 4)
    keep_arrays(rt, apfl.PERSONAL, {**rt.model.state_dict(), **v})
    sent = apfl.train_apfl(rt, message(rt, w))
    lr, a = float(rt.cfg.train.lr), 0.6

    def grad(x, scale=1.0):
        leaves = {k: t.clone().requires_grad_(True) for k, t in x.items()}
        return dict(zip(leaves, torch.autograd.grad(scale * loss_at(rt, leaves), list(leaves.values()))))

    want_w, want_v, buf = dict(w), dict(v), None
    for _ in range(2):
        g = grad(want_w)
        buf = g if buf is None else {k: 0.5 * buf[k] + g[k] for k in g}
        stepped = {k: want_w[k] - lr * buf[k] for k in g}
        mixed = {k: a * want_v[k] + a * want_w[k] for k in g}
        g = grad(mixed, a)
        buf = {k: 0.5 * buf[k] + g[k] for k in g}
        want_v = {k: want_v[k] - lr * buf[k] for k in g}
        want_w = stepped
    got_v = kept_arrays(rt, apfl.PERSONAL)
    for k in w:
        torch.testing.assert_close(got_v[k], want_v[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want_w[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm, start", [("apfl", "initial"), ("apfl", "received"),
                                              ("ditto", "initial"), ("ditto", "received")])
def test_a_clients_first_personal_model_starts_where_start_says(algorithm, start):
    """With nothing kept yet, v starts from the run's initial weights or from the received w."""
    rt = make_runtime(algorithm, [*ONE_FULL_BATCH_STEP, f"{algorithm}.start={start}", "ditto.lam=0.7"])
    initial, w = params(rt.model), perturbed(rt, 0.3, 5)
    v0 = w if start == "received" else initial
    sent = (apfl.train_apfl if algorithm == "apfl" else ditto.train_ditto)(rt, message(rt, w))
    lr = float(rt.cfg.train.lr)
    if algorithm == "apfl":
        objective = lambda x: loss_at(rt, {k: 0.75 * x[k] + 0.25 * w[k] for k in w})  # noqa: E731
    else:
        objective = lambda x: loss_at(rt, x) + 0.35 * sum(((x[k] - w[k]) ** 2).sum() for k in x)  # noqa: E731
    want_v = objective_step(rt, v0, objective, lr)
    got_v = kept_arrays(rt, apfl.PERSONAL if algorithm == "apfl" else ditto.PERSONAL)
    for k in want_v:
        torch.testing.assert_close(got_v[k], want_v[k], rtol=1e-5, atol=1e-6)
    assert ARRAYS in sent


def test_local_from_average_trains_the_received_average_only_until_it_has_its_own_model():
    """The official --alg maml path: a first model is the received average; after that the
    client trains, sends and scores its own model, whatever average it receives."""
    rt = make_runtime("local_from_average", ONE_FULL_BATCH_STEP)
    handlers, lr = ALGORITHMS["local_from_average"].handlers, float(rt.cfg.train.lr)
    first, later = perturbed(rt, 0.3, 6), perturbed(rt, 0.3, 7)
    own = objective_step(rt, first, lambda x: loss_at(rt, x), lr)
    sent = handlers["train"](rt, message(rt, first))
    own_again = objective_step(rt, own, lambda x: loss_at(rt, x), lr)
    sent_again = handlers["train"](rt, message(rt, later, server_round=2))
    for k in own:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), own[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.as_tensor(sent_again[ARRAYS][k].numpy()), own_again[k], rtol=1e-5, atol=1e-6)
    scores = handlers["evaluate"](rt, message(rt, later, server_round=2))
    rt.model.load_state_dict({**rt.model.state_dict(), **own_again})
    assert scores["metrics"]["loss"] == pytest.approx(rt.evaluate_local()["loss"], rel=1e-6)


def l2gd_objective(rt, models: list[dict[str, torch.Tensor]], i: int, lam: float):
    """L2GD's F(x) = (1/n) Σ f_j(x_j) + (λ/2n) Σ ‖x_j − x̄‖², as a function of client i's model."""
    n = len(models)

    def penalty(x):
        own = [x if j == i else m for j, m in enumerate(models)]
        mean = {k: sum(m[k] for m in own) / n for k in x}
        return lam / (2 * n) * sum(((m[k] - mean[k]) ** 2).sum() for m in own for k in x)

    return (lambda x: loss_at(rt, x) / n), penalty


@pytest.mark.parametrize("aggregation", ["paper", "official"])
def test_l2gd_steps_are_importance_weighted_gradient_steps_of_its_objective(aggregation):
    n, p, a, lam = 4, 0.8, 0.3, 0.5
    rt = make_runtime("l2gd", [*ONE_FULL_BATCH_STEP, f"l2gd.p={p}", f"l2gd.alpha={a}", f"l2gd.lam={lam}",
                               f"l2gd.aggregation={aggregation}"])
    models = [perturbed(rt, 0.2, s) for s in range(n)]
    keep_arrays(rt, l2gd.OWN_MODEL, {**rt.model.state_dict(), **models[0]})
    loss, penalty = l2gd_objective(rt, models, 0, lam)
    # a local step: x_i − α/(1 − p) · ∇_{x_i} (1/n) f_i, at the server's rate α/(n(1 − p))
    local_lr = a / (n * (1 - p))
    config = {l2gd.STEP: l2gd.LOCAL, l2gd.AVERAGE_ROUND: 0, l2gd.LOCAL_LR: local_lr, l2gd.PULL: 0.0}
    sent = l2gd.train_l2gd(rt, RecordDict({CONFIG: ConfigRecord({"server-round": 1, "variant": rt.cfg.label, **config})}))
    assert ARRAYS not in sent  # a local step sends metrics only
    want = objective_step(rt, models[0], loss, a / (1 - p))
    after_local = kept_arrays(rt, l2gd.OWN_MODEL)
    for k in want:
        torch.testing.assert_close(after_local[k], want[k], rtol=1e-5, atol=1e-6)
    # an aggregation step: x_i − α/p · ∇_{x_i} ψ (the paper); the official code steps α/(1 − p) instead
    models[0] = {k: after_local[k] for k in models[0]}
    _, penalty = l2gd_objective(rt, models, 0, lam)
    mean = {k: sum(m[k] for m in models) / n for k in models[0]}
    pull = a * lam / (n * p) if aggregation == "paper" else local_lr * lam
    config = {l2gd.STEP: l2gd.AGGREGATE, l2gd.AVERAGE_ROUND: 2, l2gd.LOCAL_LR: local_lr, l2gd.PULL: pull}
    sent = l2gd.train_l2gd(rt, message(rt, mean, server_round=3, **config))
    want = objective_step(rt, models[0], penalty, a / p if aggregation == "paper" else a / (1 - p))
    for k in want:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)
    l2gd.train_l2gd(rt, message(rt, mean, server_round=4, **config))  # the same average again: absorbed once only
    for k in want:
        torch.testing.assert_close(kept_arrays(rt, l2gd.OWN_MODEL)[k], want[k], rtol=1e-5, atol=1e-6)


def test_l2gd_clients_send_their_models_in_aggregation_steps_only(tmp_path):
    grid = run_recorded("algorithm=l2gd l2gd.p=0.5 l2gd.alpha=0.03 rounds=6", tmp_path)
    trains = [(int(m.content[CONFIG]["server-round"]), m.content[CONFIG][l2gd.STEP])
              for m in grid.sent if m.metadata.message_type == "train"]
    steps = dict(trains)
    assert set(steps.values()) == {l2gd.LOCAL, l2gd.AGGREGATE}  # this seed draws both kinds
    assert len(trains) == 6 * 6  # every client, every round
    up = [m for m in grid.replies if m.metadata.message_type == "train"]
    for sent, got in zip([m for m in grid.sent if m.metadata.message_type == "train"], up):
        assert (ARRAYS in got.content) == (sent.content[CONFIG][l2gd.STEP] == l2gd.AGGREGATE)
    # each average goes down once to each client
    down = [(m.metadata.dst_node_id, int(m.content[CONFIG][l2gd.AVERAGE_ROUND])) for m in grid.sent if ARRAYS in m.content]
    assert len(down) == len(set(down)) > 0
    assert all(m.metadata.message_type == "train" for m in grid.replies if not m.has_error() and m.content.array_records)


@pytest.mark.parametrize("override, key, allowed", [
    ("ditto.lam=-1", "ditto.lam", ">= 0"),
    ("ditto.pull=after", "ditto.pull", "after_momentum"),
    ("apfl.alpha=2", "apfl.alpha", "[0, 1]"),
    ("apfl.alpha=-0.1", "apfl.alpha", "[0, 1]"),
    ("apfl.variant=both", "apfl.variant", "official"),
    ("apfl.start=zero", "apfl.start", "received"),
    ("algorithm=apfl apfl.adaptive=true apfl.variant=official", "apfl.adaptive", "apfl.variant=paper"),
    ("ditto.start=global", "ditto.start", "received"),
    ("l2gd.p=1", "l2gd.p", "[0, 1)"),
    ("algorithm=l2gd l2gd.p=0", "l2gd.p", "never aggregates"),
    ("l2gd.alpha=0", "l2gd.alpha", "positive"),
    ("l2gd.lam=-0.5", "l2gd.lam", "positive"),
    ("l2gd.aggregation=both", "l2gd.aggregation", "official"),
])
def test_a_bad_value_is_refused_naming_its_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", override.split())
    assert str(info.value).startswith(f"{key}:") and allowed in str(info.value)


def test_apfls_global_model_takes_fedavgs_steps_value_for_value(tmp_path):
    """APFL updates w with w's own loss only (Algorithm 1): with FedAvg's seed and batches, every
    w a client sends back is FedAvg's trained model, value for value; v never feeds back."""
    def uploads(algorithm: str) -> list[list[list[float]]]:
        grid = run_recorded(f"algorithm={algorithm}", tmp_path / algorithm)
        return [[v.tolist() for v in m.content[ARRAYS].to_torch_state_dict().values()]
                for m in grid.replies if m.metadata.message_type == "train"]

    fedavg = uploads("fedavg")
    assert len(fedavg) == 12 and fedavg[0] != fedavg[-1]  # 4 rounds of 3 clients; the model moved
    assert uploads("apfl") == fedavg
