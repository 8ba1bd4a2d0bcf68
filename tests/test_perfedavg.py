"""Per-FedAvg: the meta-step against its formula written out with autograd, the Hessian-free
product against the exact one, where LocalUpdate's FOMAML/MAML clients compute the same
direction, the one-step evaluation (scored, never kept or sent), resume and config errors."""

import copy

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from torch.nn import functional as F

from flower_app.run.config import load_config
from flower_app.app.server_app import Experiment
from strategies import ALGORITHMS, perfedavg
from strategies.common import ARRAYS, CONFIG, METRICS
from strategies.local_update import maml_gradient, pseudo_gradient
from task.analysis.surrogate import Theta
from task.errors import ConfigError
from task.learning.engine import batch_slices
from task.learning.models import build_model
from tests.local_grid import LocalGrid
from tests.test_fedrep import make_runtime
from tests.test_resume import BASE

ALPHA, BETA, DELTA = 0.05, 0.1, 1e-3


def message(rt, server_round=1) -> RecordDict:
    config = ConfigRecord({"server-round": server_round, "variant": rt.cfg.label})
    return RecordDict({ARRAYS: rt.arrays(), CONFIG: config})


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def grad_at(model, weights, batch) -> list[torch.Tensor]:
    """∇ of the mean cross-entropy on ``batch`` at ``weights``, on a copy of ``model``."""
    net = copy.deepcopy(model)
    with torch.no_grad():
        for p, w in zip(net.parameters(), weights):
            p.copy_(w)
    x, y = batch
    return list(torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters())))


def expected_direction(model, w, batch, third, variant) -> list[torch.Tensor]:
    """Per-FedAvg's step direction written out: support = first 8, target = last 2 of the batch."""
    x, y = batch
    support, target = (x[:8], y[:8]), (x[8:], y[8:])
    g_support = grad_at(model, w, support)
    if variant == "official":
        return [a + b for a, b in zip(g_support, grad_at(model, w, target))]
    g = grad_at(model, [p - ALPHA * s for p, s in zip(w, g_support)], target)
    if variant == "fo":
        return g
    plus = grad_at(model, [p + DELTA * v for p, v in zip(w, g)], third)
    minus = grad_at(model, [p - DELTA * v for p, v in zip(w, g)], third)
    return [gi - ALPHA * (a - b) / (2 * DELTA) for gi, a, b in zip(g, plus, minus)]


@pytest.mark.parametrize("variant", ["hf", "fo", "official"])
@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.5, 1e-3)])
def test_meta_steps_are_the_formula_written_out(variant, momentum, weight_decay):
    """Two meta-steps of a client equal the update computed here: the same batches (the
    round's shuffle, D'' from its own), SGD by hand with momentum and weight decay on weights
    only (train.decay_biases=false, the official code's optimizer)."""
    rt = make_runtime("perfedavg", [f"perfedavg.variant={variant}", f"perfedavg.inner_lr={ALPHA}",
                                    f"perfedavg.hessian_delta={DELTA}", f"train.lr={BETA}", "train.local_steps=2",
                                    f"train.momentum={momentum}", f"train.weight_decay={weight_decay}",
                                    "train.decay_biases=false"])
    rt.reset_model()
    model = copy.deepcopy(rt.model)
    w = params_of(model)
    names = [n for n, _ in model.named_parameters()]
    batches = list(batch_slices(40, 10, rt.generator(1), torch.device("cpu")))
    thirds = list(batch_slices(40, 10, rt.generator(1, perfedavg.HESSIAN_SALT), torch.device("cpu")))
    buffers = None
    for idx, third in zip(batches[:2], thirds[:2]):
        direction = expected_direction(model, w, (rt.train.x[idx], rt.train.y[idx]),
                                       (rt.train.x[third], rt.train.y[third]), variant)
        direction = [d + (0.0 if "bias" in n else weight_decay) * p for n, d, p in zip(names, direction, w)]
        buffers = direction if buffers is None else [momentum * b + d for b, d in zip(buffers, direction)]
        w = [p - BETA * b for p, b in zip(w, buffers)]

    sent = perfedavg.train_meta(rt, message(rt))[ARRAYS].to_torch_state_dict()
    for name, expected in zip(names, w):
        torch.testing.assert_close(sent[name], expected, rtol=1e-5, atol=1e-6)
    moved = max(float((a - b).abs().max()) for a, b in zip(w, params_of(model)))
    assert moved > 1e-3  # the steps are material, so a wrong direction would show


def test_hf_and_fo_and_official_steps_differ():
    sent = {}
    for variant in ("hf", "fo", "official"):
        rt = make_runtime("perfedavg", [f"perfedavg.variant={variant}", f"perfedavg.inner_lr={ALPHA}", "train.lr=0.1"])
        rt.reset_model()
        sent[variant] = perfedavg.train_meta(rt, message(rt))[ARRAYS].to_torch_state_dict()["fc1.1.weight"]
    assert not torch.allclose(sent["hf"], sent["fo"], atol=1e-6)
    assert not torch.allclose(sent["fo"], sent["official"], atol=1e-6)


def double_problem(seed=0):
    """A float64 digits MLP and three batches (support, target, D'')."""
    torch.manual_seed(seed)
    model = build_model("digits_mlp", (1, 8, 8), 10).double()
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
               for n in (8, 2, 10)]
    return model, batches


def test_the_hessian_free_correction_approaches_the_hessian_vector_product():
    """(g_fo − g_hf)/α = d(δ) → ∇²f(w; D'')·g, the central difference's error O(δ²)."""
    model, (support, target, third) = double_problem()
    g, _ = perfedavg.meta_direction(model, support, target, F.cross_entropy, "fo", ALPHA)
    params = list(model.parameters())
    x, y = third
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
    hvp = torch.autograd.grad(sum((gr * v).sum() for gr, v in zip(grads, g)), params)
    errors = []
    for delta in (1e-2, 1e-3, 1e-4):
        hf, _ = perfedavg.meta_direction(model, support, target, F.cross_entropy, "hf", ALPHA, third, delta)
        d = [(a - b) / ALPHA for a, b in zip(g, hf)]
        errors.append(max(float((a - b).abs().max()) for a, b in zip(d, hvp)) / max(float(h.abs().max()) for h in hvp))
    assert errors[0] > 50 * errors[1] > 2500 * errors[2] and errors[2] < 1e-7, errors  # 100x per decade of δ


def test_fo_is_local_updates_fomaml_and_hf_tends_to_its_maml_when_d2_is_the_support_set():
    """Not reused, but tied: LocalUpdate's FOMAML client (Θ_2 over the batches [D, D'], γ = α)
    is exactly Per-FedAvg (FO)'s direction; LocalUpdate's exact MAML (K = 1) takes the Hessian on
    the support batch D, so it is Per-FedAvg (HF)'s limit δ → 0 with D'' := D (the paper draws
    D'' independently, which is why the HF client does not call it)."""
    model, (support, target, _) = double_problem(1)
    names = [n for n, _ in model.named_parameters()]
    fo, _ = perfedavg.meta_direction(model, support, target, F.cross_entropy, "fo", ALPHA)
    fomaml, _ = pseudo_gradient(copy.deepcopy(model), iter([support, target]), F.cross_entropy, 0.0, ALPHA,
                                Theta.last(2))
    for name, a in zip(names, fo):
        torch.testing.assert_close(a, fomaml[name], rtol=1e-12, atol=1e-14)
    maml, _ = maml_gradient(copy.deepcopy(model), iter([support, target]), F.cross_entropy, ALPHA, 1)
    hf, _ = perfedavg.meta_direction(model, support, target, F.cross_entropy, "hf", ALPHA, support, 1e-4)
    for name, a in zip(names, hf):
        torch.testing.assert_close(a, maml[name], rtol=1e-7, atol=1e-9)
    assert max(float((a - maml[n]).abs().max()) for n, a in zip(names, fo)) > 1e-6  # the Hessian term matters


def adapted_copy(rt, alpha, server_round):
    """The paper's test-time step made by hand: w − α∇f(w; B) on the seeded adaptation batch."""
    model = copy.deepcopy(rt.model)
    idx = next(batch_slices(len(rt.train), 10, rt.generator(server_round, perfedavg.ADAPT_SALT), torch.device("cpu")))
    grads = grad_at(model, params_of(model), (rt.train.x[idx], rt.train.y[idx]))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(alpha * g)
    return model


def test_evaluation_scores_the_adapted_model_and_keeps_nothing():
    rt = make_runtime("perfedavg", ["perfedavg.inner_lr=2.0"])
    rt.reset_model()
    content = message(rt, server_round=3)
    received = {k: v.clone() for k, v in rt.model.state_dict().items()}
    unadapted = rt.evaluate_local()
    rt.model = adapted_copy(rt, 2.0, 3)
    by_hand = rt.evaluate_local()
    rt.model.load_state_dict(received)

    out = perfedavg.evaluate_adapted(rt, content)
    assert ARRAYS not in out  # the adapted weights are never sent
    scores = dict(out[METRICS])
    assert scores["accuracy"] == pytest.approx(by_hand["accuracy"]) and scores["loss"] == pytest.approx(by_hand["loss"])
    assert scores["accuracy"] != unadapted["accuracy"]
    for k, v in rt.model.state_dict().items():  # nor kept: the model is the received one again
        assert torch.equal(v, received[k]), k

    rt = make_runtime("perfedavg", ["perfedavg.inner_lr=2.0", "perfedavg.eval_adaptation=none"])
    rt.reset_model()
    scores = dict(perfedavg.evaluate_adapted(rt, message(rt, server_round=3))[METRICS])
    assert scores["accuracy"] == unadapted["accuracy"] and scores["loss"] == pytest.approx(unadapted["loss"])


def test_through_the_loop_only_the_model_crosses_the_wire(tmp_path):
    overrides = f"{BASE} algorithm=perfedavg rounds=2 perfedavg.inner_lr=0.01 out_dir={tmp_path}"
    grid = LocalGrid(6, {"experiment": "quickstart", "overrides": overrides})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "completed" and ALGORITHMS["perfedavg"].evaluates_on_clients
    keys = set(build_model("digits_mlp", (1, 8, 8), 10).state_dict())
    kinds = {r.metadata.message_type for r in grid.replies}
    assert {"train", "evaluate"} <= kinds
    for r in grid.replies:
        if r.metadata.message_type == "train":
            assert set(r.content[ARRAYS]) == keys
        if r.metadata.message_type == "evaluate":
            assert not r.content.array_records


@pytest.mark.parametrize("override, key, allowed", [
    ("perfedavg.inner_lr=-1", "perfedavg.inner_lr", "positive"),
    ("perfedavg.inner_lr=0", "perfedavg.inner_lr", "positive"),
    ("perfedavg.hessian_delta=0", "perfedavg.hessian_delta", "positive"),
    ("perfedavg.hessian_delta=-0.001", "perfedavg.hessian_delta", "positive"),
    ("perfedavg.support_fraction=0", "perfedavg.support_fraction", "(0, 1)"),
    ("perfedavg.support_fraction=1", "perfedavg.support_fraction", "(0, 1)"),
    ("perfedavg.support_fraction=1.5", "perfedavg.support_fraction", "(0, 1)"),
    ("perfedavg.support_fraction=0.05", "perfedavg.support_fraction", "support or the target set empty"),
    ("train.batch_size=1", "perfedavg.support_fraction", "train.batch_size=1"),
    ("perfedavg.variant=maml", "perfedavg.variant", "hf, fo, official"),
    ("perfedavg.eval_adaptation=two_steps", "perfedavg.eval_adaptation", "one_step, none"),
])
def test_bad_values_are_refused_naming_the_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", ["algorithm=perfedavg", "compare=[]", override])
    assert key in str(info.value) and allowed in str(info.value), str(info.value)
