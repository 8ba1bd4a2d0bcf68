"""Fed-MTL: one client step follows the objective's gradient, resume, config checks, and only the
regularised first layers ever leave a client."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch.nn import functional as F

from flower_app.run.config import load_config, load_variants, validate_with_data
from flower_app.app.server_app import run_variants
from strategies import fed_mtl
from strategies.common import ARRAYS, CONFIG, ClientRuntime
from task.errors import ConfigError
from task.learning.engine import TensorData, step_batches
from task.learning.models import build_model
from tests.local_grid import LocalGrid


def make_runtime(overrides=()):
    cfg = load_config("quickstart", ["algorithm=fed_mtl", "compare=[]", *overrides])
    torch.manual_seed(0)
    model = build_model("digits_mlp", (1, 8, 8), 10)
    g = torch.Generator().manual_seed(0)
    train = TensorData(torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g))
    test = TensorData(torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, 10, (20,), generator=g))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return ClientRuntime(cfg, 0, torch.device("cpu"), train, test, model, ["fc2"], initial)


def train_message(rt, server_round, others_sum, m):
    config = ConfigRecord({"server-round": server_round, "variant": rt.cfg.label, fed_mtl.COLUMNS: m})
    return RecordDict({ARRAYS: ArrayRecord({k: v.clone() for k, v in others_sum.items()}), CONFIG: config})


def omega(kind, m):
    """Ω as the paper writes it (a matrix square) and as the official code computes it."""
    ones = torch.ones(m, 1, dtype=torch.float64)
    if kind == "paper":
        centre = torch.eye(m, dtype=torch.float64) - ones @ ones.T / m
        return centre @ centre
    return (torch.ones(m, m, dtype=torch.float64) - ones @ ones.T / m) ** 2


@pytest.mark.parametrize("kind, lams", [("paper", ("0.3", "0.05")), ("official", ("0.2", "0.1")),
                                        ("paper", ("null", "null"))])
def test_one_step_follows_the_gradient_of_the_objective(kind, lams):
    rt = make_runtime(["train.local_steps=1", "train.momentum=0", "train.weight_decay=0", f"mtl.omega={kind}",
                       f"mtl.lam1={lams[0]}", f"mtl.lam2={lams[1]}"])
    keys = fed_mtl.regularised_keys(rt.model, rt.cfg)
    assert keys == ["fc1.1.weight", "fc1.1.bias"]
    state = rt.model.state_dict()
    m = 4
    g = torch.Generator().manual_seed(1)
    others = [{k: state[k] + 0.3 * torch.randn(state[k].shape, generator=g) for k in keys} for _ in range(m - 1)]
    others_sum = {k: sum(o[k] for o in others) for k in keys}
    fed_mtl.train_mtl(rt, train_message(rt, 1, others_sum, m))  # round 1: the client's own model moves
    start = {k: v.clone() for k, v in rt.model.state_dict().items()}
    fed_mtl.train_mtl(rt, train_message(rt, 2, others_sum, m))
    stepped = rt.state[rt.state_key(fed_mtl.STATE_KEY)].to_torch_state_dict()

    # the objective f_i(w_i) + λ₁ tr(WΩWᵀ) + λ₂‖W‖²_F on the step's batch, by autograd
    d = sum(start[k].numel() for k in keys)
    lam1, lam2 = (10.0 ** -(len(str(d)) + 1) if v == "null" else float(v) for v in lams)
    assert d == 4160 and (lams[0] != "null" or lam1 == 1e-5)  # the official scale: d has 4 digits
    w = {k: v.clone().double().requires_grad_(True) for k, v in start.items()}
    model = build_model("digits_mlp", (1, 8, 8), 10).double()
    idx = next(step_batches(len(rt.train), int(rt.cfg.train.batch_size), rt.generator(2), rt.device, None, 1))
    out = torch.func.functional_call(model, w, (rt.train.x[idx].double(),))
    columns = [torch.cat([w[k].flatten() for k in keys])]
    columns += [torch.cat([o[k].double().flatten() for k in keys]) for o in others]
    big_w = torch.stack(columns, dim=1)  # (d, M), client i in column 0
    trace = torch.trace(big_w @ omega(kind, m) @ big_w.T)
    objective = F.cross_entropy(out, rt.train.y[idx]) + lam1 * trace + lam2 * big_w.pow(2).sum()
    objective.backward()
    lr = float(rt.cfg.train.lr)
    for k in start:
        expected = start[k].double() - lr * w[k].grad
        torch.testing.assert_close(stepped[k].double(), expected, rtol=1e-5, atol=1e-6, msg=k)

    # the split regularisers add up: Σ_k ‖w_k − w̄‖² is the trace (paper), Σ_k ‖w_k‖² the norm
    mean = big_w.mean(dim=1, keepdim=True)
    if kind == "paper":
        torch.testing.assert_close(((big_w - mean) ** 2).sum(), trace)
    else:
        torch.testing.assert_close((1 - 1 / m) ** 2 * big_w.sum(dim=1).pow(2).sum(), trace)
    torch.testing.assert_close(sum(c.pow(2).sum() for c in columns), big_w.pow(2).sum())
    # the regulariser moved the step: without it the same step differs
    if kind == "paper" and lams[0] != "null":
        plain = {k: start[k].double() - lr * torch.autograd.grad(
            F.cross_entropy(torch.func.functional_call(model, w, (rt.train.x[idx].double(),)), rt.train.y[idx]),
            w[k])[0] for k in keys}
        assert not torch.allclose(stepped[keys[0]].double(), plain[keys[0]], atol=1e-4)


def test_the_client_refuses_arrays_that_are_not_its_regularised_layers():
    rt = make_runtime()
    state = rt.model.state_dict()
    with pytest.raises(ValueError, match="fc1"):
        fed_mtl.train_mtl(rt, train_message(rt, 1, {"fc2.weight": state["fc2.weight"]}, 2))


@pytest.mark.parametrize("override, key, allowed", [
    ("mtl.lam1=-1", "mtl.lam1", ">= 0"),
    ("mtl.lam2=-0.5", "mtl.lam2", ">= 0"),
    ("mtl.first_groups=0", "mtl.first_groups", "positive"),
    ("mtl.first_groups=3", "mtl.first_groups", "at most 2"),
    ("mtl.omega=identity", "mtl.omega", "official"),
    ("mtl.columns=some", "mtl.columns", "sampled"),
])
def test_bad_values_are_refused_naming_the_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        validate_with_data(load_config("quickstart", ["algorithm=fed_mtl", "compare=[]", override]))
    assert key in str(info.value) and allowed in str(info.value)


def test_only_the_regularised_layers_ever_leave_a_client(tmp_path):
    overrides = f"algorithm=fed_mtl compare=[] rounds=3 train.fraction=1.0 mtl.lam1=0.5 wandb.enabled=false out_dir={tmp_path}"
    grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    assert summary["status"] == "completed" and summary["personalized_accuracy"] is not None
    cfg = load_config("quickstart", overrides.split())
    model = validate_with_data(cfg)[1]  # the run's seeded initial model
    regularised = set(fed_mtl.regularised_keys(model, cfg))
    assert regularised == {"fc1.1.weight", "fc1.1.bias"}
    train_replies = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert len(train_replies) == 3 * 20
    for msg in grid.sent + grid.replies:
        for record in msg.content.array_records.values():
            assert not set(record) - regularised, f"{msg.metadata.message_type} message carried {set(record)}"
    assert not any(len(record) for m in grid.sent + grid.replies if m.metadata.message_type == "evaluate"
                   for record in m.content.array_records.values())
    reg_params = sum(model.state_dict()[k].numel() for k in regularised)
    assert summary["params_up"] == summary["params_down"] == 60 * reg_params

    # by value: each client's last reply is its kept regularised layers, and no sent array holds a kept other layer
    node_of_reply = {}
    for rep in train_replies:
        node_of_reply[rep.metadata.src_node_id] = rep.content[ARRAYS].to_torch_state_dict()
    initial = model.state_dict()
    for node, sent in node_of_reply.items():
        kept = grid.contexts[node].state[f"{cfg.label}/{fed_mtl.STATE_KEY}"].to_torch_state_dict()
        for k in regularised:
            assert torch.equal(sent[k], kept[k])
        others = [v for k, v in kept.items() if k not in regularised]
        assert any(not torch.equal(kept[k], initial[k]) for k in kept if k not in regularised)  # they trained
        for rep in train_replies:
            if rep.metadata.src_node_id != node:
                continue
            for array in rep.content[ARRAYS].to_torch_state_dict().values():
                for v in others:  # neither the same array nor one holding all of its values
                    assert not (array.shape == v.shape and torch.equal(array, v))
                    assert not torch.isin(v.flatten(), array.flatten()).all()
