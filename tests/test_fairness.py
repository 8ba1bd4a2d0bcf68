"""Fair local representations (LG-FedAvg Section 3.3, Table 4): data, objective, metrics, protocol."""

import copy
import itertools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from flower_app.cli import main as flrep
from flower_app.run.config import load_variants
from flower_app.app.server_app import run_variants
from strategies import ALGORITHMS
from strategies.common import ARRAYS
from task.data.datasets.adult import load_adult
from task.learning.engine import OptimizerConfig, TensorData
from task.errors import ConfigError
from task.learning.fairness import adversary_loss, postfit_adversary_auc, train_fair
from task.learning.models import FairMLP
from tests import local_grid
from tests.local_grid import LocalGrid
from tests.offline_data import shared


def test_fairness_split_follows_the_paper():
    bundle = load_adult(shared("adult"), {"adult_split": "fairness"}, normalize=True)
    assert bundle.train.x.shape == (15_000, 93) and bundle.test.x.shape == (15_000, 93)
    names = bundle.meta["feature_names"]
    assert not any(n.startswith(("race", "sex", "fnlwgt")) for n in names)
    for split in (bundle.train, bundle.test):
        assert set(np.unique(split.attributes["race"])) == {0, 1} and set(np.unique(split.attributes["sex"])) == {0, 1}
    assert abs(bundle.train.y.mean() - bundle.test.y.mean()) < 0.01  # label-stratified halves
    np.testing.assert_allclose(bundle.train.x.mean(axis=0), 0, atol=1e-5)


def _tiny(seed=0, n=64):
    torch.manual_seed(seed)
    model = FairMLP(5, 2, dropout=0.0)
    x = torch.randn(n, 5)
    data = TensorData(x, (x[:, 0] > 0).long(), torch.stack([(x[:, 1] > 0), (x[:, 2] > 0)], 1).float())
    return model, data


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("penalize", [True, False])
def test_objective_signs_adversary_descends_la_model_descends_lg_minus_lambda_la(penalize):
    model, data = _tiny()
    lam, lr = torch.tensor([3.0, 5.0]), 0.1
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_fair(model, data, OptimizerConfig(lr=lr), batch_size=len(data), generator=torch.Generator().manual_seed(0),
               epochs=1, lambdas=lam.tolist(), penalize=penalize)
    # 1. adversary: one gradient step down L_a on the detached representation
    h = ref.representation(data.x)
    g_adv = _grads(ref, adversary_loss(ref, h.detach(), data.z))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.startswith("adversary."):
                p -= lr * g_adv[n]
    # 2. model: a step down L_g - mean_j lambda_j L_a,j (the adversary already updated)
    h = ref.representation(data.x)
    g_class = _grads(ref, F.cross_entropy(ref.classify(h), data.y))
    g_pen = _grads(ref, adversary_loss(ref, ref.representation(data.x), data.z, lam))
    for n, p in model.named_parameters():
        if n.startswith("adversary."):
            expected = before[n] - lr * g_adv[n]
        else:
            expected = before[n] - lr * (g_class[n] - (g_pen[n] if penalize else 0))
            if n.startswith("g"):
                assert torch.count_nonzero(g_pen[n]) == 0  # the penalty never reaches the classifier
        torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-6)
    assert any(torch.count_nonzero(g_pen[n]) for n in g_pen if n.startswith("fc"))


def test_penalty_pushes_the_adversary_loss_up():
    losses = {}
    for penalize in (False, True):
        model, data = _tiny(1, n=512)
        train_fair(model, data, OptimizerConfig(lr=0.1, momentum=0.5), 32, torch.Generator().manual_seed(0), 30,
                   [1.0, 1.0], penalize, model_step=False)  # adversary only, same start
        with torch.no_grad():
            start = adversary_loss(model, model.representation(data.x), data.z).item()
        adv = [p.detach().clone() for p in model.adversary.parameters()]
        for _ in range(20):
            train_fair(model, data, OptimizerConfig(lr=0.05), 512, torch.Generator().manual_seed(0), 1, [10.0, 10.0],
                       penalize)
            with torch.no_grad():  # hold the adversary fixed: only the model's effect counts
                for p, a in zip(model.adversary.parameters(), adv):
                    p.copy_(a)
        with torch.no_grad():
            losses[penalize] = adversary_loss(model, model.representation(data.x), data.z).item() - start
    assert losses[True] > 0.004 and losses[True] > 100 * abs(losses[False])


def test_postfit_check_finds_an_attribute_the_representation_carries():
    model, data = _tiny(2, n=2000)
    auc = postfit_adversary_auc(model, data, data, ["race", "sex"], OptimizerConfig(lr=0.1, momentum=0.5), 32, 20,
                                torch.Generator().manual_seed(0))
    assert auc["postfit_auc_race"] > 0.85 and auc["postfit_auc_sex"] > 0.85
    blind = TensorData(data.x, data.y, torch.randint(0, 2, data.z.shape, generator=torch.Generator().manual_seed(1)).float())
    auc = postfit_adversary_auc(model, blind, blind, ["race", "sex"], OptimizerConfig(lr=0.1), 32, 5,
                                torch.Generator().manual_seed(0))
    assert all(abs(v - 0.5) < 0.1 for v in auc.values())


def test_adversarial_penalty_is_for_lg_fedavg_only():
    with pytest.raises(ConfigError, match="fair.adversarial"):
        load_variants("lg_fair_adult", ["algorithm=fedavg", "compare=[]"])


@pytest.mark.parametrize("algorithm", sorted(n for n, a in ALGORITHMS.items() if not a.trains_fair_model))
def test_the_fair_model_is_refused_for_an_algorithm_that_does_not_declare_it(algorithm):
    with pytest.raises(ConfigError, match=rf"model.name: adult_fair .*algorithm={algorithm} does not run"):
        load_variants("lg_fair_adult", [f"algorithm={algorithm}", "compare=[]", "fair.adversarial=false"])


def test_fedrep_with_the_fair_model_stops_before_round_one_and_writes_nothing(tmp_path, capsys):
    shared("adult")  # the data is checked first
    out = tmp_path / "run"
    assert flrep(["run", "lg_fair_adult", "algorithm=fedrep", "compare=[]", "fair.adversarial=false",
                  "--out", str(out)]) == 2
    assert "model.name: adult_fair trains with its own objective" in capsys.readouterr().err
    assert not out.exists()


def test_the_algorithms_that_declare_the_fair_model_accept_it():
    assert sorted(n for n, a in ALGORITHMS.items() if a.trains_fair_model) == ["fedavg", "lg_fedavg"]
    for cfg in load_variants("lg_fair_adult"):
        assert cfg.model.name == "adult_fair"


def test_fair_lg_run_keeps_representation_and_adversary_on_the_clients(tmp_path):
    shared("adult")
    overrides = (f"wandb.enabled=false out_dir={tmp_path} compare=[] rounds=2 train.local_epochs=1 "
                 "fair.pretrain_epochs=1 fair.postfit_epochs=1")
    grid = LocalGrid(10, {"experiment": "lg_fair_adult", "overrides": overrides})
    summary = run_variants(grid, load_variants("lg_fair_adult", overrides.split()))
    global_part = {"g1.0.weight", "g1.0.bias", "g2.0.weight", "g2.0.bias", "g3.weight", "g3.bias"}
    for rep in grid.replies:
        if ARRAYS in rep.content and rep.metadata.message_type == "train":
            assert set(rep.content[ARRAYS]) == global_part
    expected = {"class_auc": 0.7814, "adversary_auc": 0.5333, "adversary_auc_race": 0.4460,  # this seed's numbers
                "adversary_auc_sex": 0.6207, "postfit_auc": 0.7075, "personalized_accuracy": 0.7561}
    assert {k: summary[k] for k in expected} == pytest.approx(expected, abs=0.01)


def test_a_run_with_dropout_repeats_exactly_whatever_the_processes_random_state(tmp_path, monkeypatch):
    """``adult_fair`` has dropout, which draws from torch's global generator. A client seeds it
    per message from (seed, round, client, type), so the same seed gives the same numbers
    whichever worker process, with whatever earlier draws, serves each client."""
    shared("adult")
    app, results = local_grid.client_app, []
    for history in (1, 2):
        messages = itertools.count()

        def served_by_another_process(msg, context, history=history, messages=messages):
            torch.manual_seed(1000 * history + next(messages))  # that process's earlier draws
            return app(msg, context)

        monkeypatch.setattr(local_grid, "client_app", served_by_another_process)
        overrides = (f"wandb.enabled=false out_dir={tmp_path / str(history)} compare=[] rounds=2 "
                     "train.local_epochs=1 fair.pretrain_epochs=1 fair.postfit_epochs=1")
        grid = LocalGrid(10, {"experiment": "lg_fair_adult", "overrides": overrides})
        run_variants(grid, load_variants("lg_fair_adult", overrides.split()))
        results.append([rep.content[ARRAYS] for rep in grid.replies
                        if rep.metadata.message_type == "train" and ARRAYS in rep.content])
    first, second = results
    assert len(first) == len(second) > 0
    for a, b in zip(first, second):
        assert set(a) == set(b)
        for key in a:
            assert np.array_equal(a[key].numpy(), b[key].numpy()), key
