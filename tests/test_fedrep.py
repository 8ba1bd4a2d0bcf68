"""FedRep and FedPer: what leaves the client, the kept head, the frozen phases, cold starts."""

import json
from collections import OrderedDict

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from flower_app.run.config import load_config, load_variants
from flower_app.app.server_app import run_variants
from strategies import ALGORITHMS, fedrep
from strategies.common import ARRAYS, CONFIG, METRICS, ClientRuntime, body_keys, head_keys
from task.learning.engine import TensorData
from task.learning.inference import evaluate
from task.errors import ConfigError
from task.learning.models import build_model
from task.learning.split_model import SplitModel
from tests.local_grid import LocalGrid


def make_runtime(algorithm="fedrep", overrides=(), seed=0, state=None, model=None):
    cfg = load_config("quickstart", [f"algorithm={algorithm}", "compare=[]", *overrides])
    torch.manual_seed(cfg.seed)
    model = model if model is not None else build_model("digits_mlp", (1, 8, 8), 10)
    g = torch.Generator().manual_seed(seed)
    train = TensorData(torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g))
    test = TensorData(torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, 10, (20,), generator=g))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return ClientRuntime(cfg, seed, torch.device("cpu"), train, test, model, ["fc2"], initial,
                         state=state if state is not None else RecordDict())


def body_message(rt, server_round=1):
    state = rt.model.state_dict()
    arrays = ArrayRecord({k: state[k].clone() for k in body_keys(rt.model, rt.cfg)})
    config = ConfigRecord({"server-round": server_round, "lr": float(rt.cfg.train.lr), "variant": rt.cfg.label})
    return RecordDict({ARRAYS: arrays, CONFIG: config})


def snapshot(model, keys):
    state = model.state_dict()
    return {k: state[k].clone() for k in keys}


@pytest.mark.parametrize("algorithm", ["fedrep", "fedper"])
def test_no_head_parameter_ever_leaves_a_client(tmp_path, algorithm):
    overrides = f"algorithm={algorithm} compare=[] rounds=3 train.fraction=1.0 wandb.enabled=false out_dir={tmp_path}"
    grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    assert summary["status"] == "completed"
    model = build_model("digits_mlp", (1, 8, 8), 10)
    cfg = load_config("quickstart", overrides.split())
    head, body = set(head_keys(model, cfg)), set(body_keys(model, cfg))
    assert head == {"fc2.weight", "fc2.bias"}
    train_replies = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert len(train_replies) == 3 * 20
    for msg in grid.sent + grid.replies:
        for record in msg.content.array_records.values():
            assert not head & set(record), f"{msg.metadata.message_type} message carried head arrays"
    for rep in train_replies:
        assert set(rep.content[ARRAYS]) == body
    # the server's traffic count matches: body parameters only, 5 clients x 3 rounds
    body_params = sum(model.state_dict()[k].numel() for k in body)
    assert summary["params_up"] == 60 * body_params


def test_head_survives_across_rounds_in_client_state():
    state = RecordDict()
    rt = make_runtime(state=state)
    rt.reset_model()
    fedrep.train_fedrep(rt, body_message(rt, 1))
    kept = state[rt.state_key("head")].to_torch_state_dict()
    # another client runs on the same (worker-shared) model object and changes its head
    other = make_runtime(seed=1)
    other.model = rt.model
    fedrep.train_fedrep(other, body_message(other, 1))
    assert not torch.equal(rt.model.state_dict()["fc2.weight"], kept["fc2.weight"])
    # round 2 of the first client starts from its own kept head, not the model's current one
    seen = {}
    real_fit = fedrep.fit_head

    def spy(rt_, *args, **kwargs):
        seen.update(snapshot(rt_.model, ["fc2.weight", "fc2.bias"]))
        return real_fit(rt_, *args, **kwargs)

    fedrep.fit_head = spy
    try:
        fedrep.train_fedrep(rt, body_message(rt, 2))
    finally:
        fedrep.fit_head = real_fit
    for key, value in kept.items():
        torch.testing.assert_close(seen[key], value)


def test_each_phase_leaves_the_frozen_part_unchanged(monkeypatch):
    rt = make_runtime()
    rt.reset_model()
    head, body = head_keys(rt.model, rt.cfg), body_keys(rt.model, rt.cfg)
    body_before = snapshot(rt.model, body)
    head_before = snapshot(rt.model, head)
    fedrep.fit_head(rt, 1)
    for k, v in snapshot(rt.model, body).items():
        assert torch.equal(v, body_before[k]), f"head phase changed body {k}"
    assert any(not torch.equal(v, head_before[k]) for k, v in snapshot(rt.model, head).items())

    import strategies.common as common

    calls = []
    real_train = common.train

    def body_phase(model, *args, **kwargs):
        before = snapshot(model, head + body)
        result = real_train(model, *args, **kwargs)
        after = snapshot(model, head + body)
        calls.append((before, after))
        return result

    monkeypatch.setattr(common, "train", body_phase)
    fedrep.train_fedrep(rt, body_message(rt, 1))
    (before, after), = calls
    for k in head:
        assert torch.equal(before[k], after[k]), f"body phase changed head {k}"
    assert any(not torch.equal(before[k], after[k]) for k in body)


def dropout_mlp():
    """digits_mlp's shape with Dropout(0.5) at the end of the body (as FedRep's CIFAR-100 CNN has)."""
    torch.manual_seed(0)
    return SplitModel(OrderedDict(fc1=nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5)),
                                  fc2=nn.Linear(64, 10)))


def fitted_head(mode, model=None):
    """The head after one head phase in ``fedrep.head_features`` mode, and the body before and after."""
    rt = make_runtime(overrides=[f"fedrep.head_features={mode}"], model=model)
    rt.reset_model()
    body = body_keys(rt.model, rt.cfg)
    before = snapshot(rt.model, body)
    fedrep.fit_head(rt, 1)
    assert all(p.requires_grad for p in rt.model.parameters())  # the frozen body is trainable again
    return snapshot(rt.model, head_keys(rt.model, rt.cfg)), before, snapshot(rt.model, body)


def test_train_mode_head_phase_keeps_the_body_and_samples_dropout():
    """The official head epochs: train-mode forward passes with the body frozen. With dropout in
    the body they differ from the eval-mode feature cache; without, they agree up to rounding."""
    head, body_before, body_after = fitted_head("train_mode", dropout_mlp())
    for k, v in body_before.items():
        assert torch.equal(v, body_after[k]), f"train-mode head phase changed body {k}"
    cached, _, _ = fitted_head("eval", dropout_mlp())
    assert not torch.allclose(head["fc2.weight"], cached["fc2.weight"], atol=1e-3)
    assert not torch.equal(head["fc2.weight"], dropout_mlp().state_dict()["fc2.weight"])
    plain, _, _ = fitted_head("train_mode")
    plain_cached, _, _ = fitted_head("eval")
    for k, v in plain.items():
        torch.testing.assert_close(v, plain_cached[k], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="fedrep.head_features"):
        load_config("quickstart", ["fedrep.head_features=train_mode", "fedrep.head_solver=exact"])


def test_train_mode_head_phase_runs_in_the_real_loop(tmp_path, monkeypatch):
    """The key reaches every client's head phase; on a model without dropout the run matches the eval-mode one."""
    calls = []
    real = fedrep.train_head_in_train_mode

    def counted(*args, **kwargs):
        calls.append(kwargs["augment"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fedrep, "train_head_in_train_mode", counted)
    overrides = (f"wandb.enabled=false out_dir={tmp_path} rounds=3 "
                 "compare=['fedrep.head_features=train_mode label=fedrep-train-mode']")
    grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    assert calls == [None] * 15  # 5 clients x 3 rounds, train.augment=none
    comp = summary["comparison"]
    assert comp["fedrep-train-mode"]["personalized_accuracy"] == pytest.approx(comp["fedrep"]["personalized_accuracy"])


def test_weight_decay_does_not_touch_the_frozen_head():
    rt = make_runtime(overrides=["train.weight_decay=0.1", "fedrep.head_epochs=0"])
    rt.reset_model()
    head_before = snapshot(rt.model, head_keys(rt.model, rt.cfg))
    fedrep.train_fedrep(rt, body_message(rt, 1))
    kept = rt.state[rt.state_key("head")].to_torch_state_dict()
    for k, v in head_before.items():
        assert torch.equal(kept[k], v)


def test_fedper_trains_head_and_body_jointly_and_keeps_the_head():
    from strategies import fedper

    rt = make_runtime("fedper")
    rt.reset_model()
    start = snapshot(rt.model, list(rt.model.state_dict()))
    out = fedper.train_fedper(rt, body_message(rt, 1))
    kept = rt.state[rt.state_key("head")].to_torch_state_dict()
    assert set(out[ARRAYS]) == set(body_keys(rt.model, rt.cfg))
    assert all(not torch.equal(kept[k], start[k]) for k in kept)
    assert all(not torch.equal(torch.from_numpy(out[ARRAYS][k].numpy()), start[k]) for k in ("fc1.1.weight",))
    assert out[METRICS]["local_steps"] == 4  # 40 samples, batch 10, one epoch


@pytest.mark.parametrize("algorithm", ["fedrep", "fedper"])
def test_never_sampled_client_is_evaluated_with_a_head_fitted_on_its_data(algorithm):
    rt = make_runtime(algorithm, overrides=["fedrep.unsampled_head=fit"])
    rt.reset_model()
    algo = ALGORITHMS[algorithm]
    content = body_message(rt, 3)
    result = algo.handlers["evaluate"](rt, content)[METRICS]
    assert rt.state_key("head") not in rt.state  # evaluation keeps nothing
    reference = make_runtime(algorithm)
    reference.reset_model()
    random_head = evaluate(reference.model, reference.train).accuracy
    fedrep.fit_head(reference, 3, fedrep.COLD_START_SALT)
    assert result["accuracy"] == pytest.approx(evaluate(reference.model, reference.test).accuracy)
    assert evaluate(reference.model, reference.train).accuracy > random_head + 0.2


@pytest.mark.parametrize("algorithm", ["fedrep", "fedper"])
def test_never_sampled_client_is_evaluated_with_the_initial_head_by_default(algorithm):
    """The official code's protocol: the received body with the run's initial head, nothing fitted."""
    rt = make_runtime(algorithm)
    assert rt.cfg.fedrep.unsampled_head == "initial"
    rt.reset_model()
    content = body_message(rt, 3)
    result = ALGORITHMS[algorithm].handlers["evaluate"](rt, content)[METRICS]
    assert rt.state_key("head") not in rt.state
    reference = make_runtime(algorithm)
    reference.reset_model()
    reference.load(content[ARRAYS])  # the received body; the head stays the initial one
    expected = evaluate(reference.model, reference.test)
    assert result["accuracy"] == expected.accuracy
    assert result["loss"] == pytest.approx(expected.loss)
    fedrep.fit_head(reference, 3, fedrep.COLD_START_SALT)
    assert evaluate(reference.model, reference.test).loss != pytest.approx(expected.loss)  # a fit would differ


def test_exact_head_solver_is_least_squares_and_orthonormalize_keeps_the_span():
    model = build_model("linear_rep", (6,), 1, rep_dim=2)
    g = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(30, 6, generator=g), torch.randn(30, generator=g))
    from task.learning.heads import fit_head_least_squares

    fit_head_least_squares(model, ["head"], data)
    z = (data.x @ model.body.weight.T).double()
    w = torch.linalg.lstsq(z, data.y.double().unsqueeze(1)).solution.T
    torch.testing.assert_close(model.head.weight.double(), w, rtol=1e-5, atol=1e-6)

    weight = torch.randn(2, 6, generator=g)
    out = fedrep.orthonormalize_body(ArrayRecord({"body.weight": weight})).to_torch_state_dict()["body.weight"]
    torch.testing.assert_close(out @ out.T, torch.eye(2), rtol=0, atol=1e-6)
    # same row space: projecting the old rows onto the new basis loses nothing
    torch.testing.assert_close(weight @ out.T @ out, weight, rtol=1e-5, atol=1e-5)


def test_exact_solver_needs_regression_and_orthonormalize_needs_the_linear_model():
    from flower_app.run.config import validate_with_data

    with pytest.raises(ConfigError, match="fedrep.head_solver"):
        validate_with_data(load_config("quickstart", ["fedrep.head_solver=exact"]))
    with pytest.raises(ConfigError, match="fedrep.orthonormalize"):
        load_config("quickstart", ["fedrep.orthonormalize=true"])
    with pytest.raises(ConfigError, match="server_opt.name"):
        load_config("quickstart", ["server_opt.name=fedavgm"])
    with pytest.raises(ConfigError, match=r"compare\[0\].*finetune.enabled"):  # caught before any variant runs
        load_variants("quickstart", ["compare=['algorithm=lg_fedavg finetune.enabled=true']"])


def test_variants_need_distinct_labels_and_report_the_bad_entry():
    with pytest.raises(ConfigError, match="label"):
        load_variants("quickstart", ["compare=[algorithm=fedrep]"])
    with pytest.raises(ConfigError, match=r"compare\[0\].*algorithm"):
        load_variants("quickstart", ["compare=[algorithm=nope]"])
    with pytest.raises(ConfigError, match=r"compare\[0\].*cannot differ"):
        load_variants("quickstart", ["compare=['algorithm=fedavg data.num_clients=5']"])
    labels = [v.label for v in load_variants("quickstart", ["compare=['algorithm=fedavg', 'algorithm=fedavg label=dsgd train.local_steps=1']"])]
    assert labels == ["fedrep", "fedavg", "dsgd"]


def test_quickstart_compares_fedrep_with_fedavg(tmp_path):
    overrides = f"wandb.enabled=false out_dir={tmp_path}"
    grid = LocalGrid(20, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    assert summary["variants"] == ["fedrep", "fedavg"]
    assert summary["kind"] == "comparison" and "algorithm" not in summary and "personalized_accuracy" not in summary
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    comp = summary["comparison"]
    assert comp["fedrep"]["algorithm"] == "fedrep" and comp["fedavg"]["status"] == "completed"
    assert summary["wall_time_s"] == pytest.approx(comp["fedrep"]["wall_time_s"] + comp["fedavg"]["wall_time_s"])
    assert comp["fedrep"]["personalized_accuracy"] > comp["fedavg"]["personalized_accuracy"] + 0.05
    assert comp["fedrep"]["global_accuracy"] is None and comp["fedavg"]["global_accuracy"] > 0.5
    table = (tmp_path / "comparison.md").read_text()
    assert "| fedrep |" in table and "| fedavg |" in table
    for label in ("fedrep", "fedavg"):
        assert (tmp_path / label / "metrics.jsonl").is_file()
        assert (tmp_path / label / "summary.json").is_file()
    assert (tmp_path / "plots" / "comparison.png").stat().st_size > 0


def test_new_clients_with_held_out_classes_adapt_a_head_on_the_frozen_body(tmp_path):
    overrides = (f"wandb.enabled=false out_dir={tmp_path} rounds=5 compare=[algorithm=fedavg] data.num_clients=30 "
                 "data.num_new_clients=10 data.new_client_classes=[5,6,7,8,9] data.new_client_classes_per_client=3 "
                 "data.new_client_train_size=80 data.new_client_test_size=30 new_clients.epochs=4")
    grid = LocalGrid(30, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    from task.data.federated_data import build_federated_data

    cfg = load_variants("quickstart", overrides.split())[0]
    fed = build_federated_data(cfg.data, cfg.seed)
    y = fed.bundle.train.y
    assert all(set(y[fed.client_train[p]]) <= {0, 1, 2, 3, 4} for p in range(20))
    assert all(len(set(y[fed.client_train[p]])) == 3 and set(y[fed.client_train[p]]) <= {5, 6, 7, 8, 9}
               for p in range(20, 30))
    assert set(fed.bundle.test.y[fed.global_test]) == {0, 1, 2, 3, 4}
    # new clients were never trained on or evaluated during training
    trained = {int(grid.contexts[m.metadata.dst_node_id].node_config["partition-id"])
               for m in grid.sent if m.metadata.message_type in ("train", "evaluate")}
    assert trained and max(trained) < 20
    adapted = [m for m in grid.sent if m.metadata.message_type == "train.newclient"]
    assert len(adapted) == 2 * 10
    body = set(body_keys(build_model("digits_mlp", (1, 8, 8), 10), cfg))
    assert all(set(m.content[ARRAYS]) == body for m in adapted)
    for label in ("fedrep", "fedavg"):
        curve = summary["comparison"][label]["newclient_accuracy"]
        by_epoch = json.loads((tmp_path / label / "summary.json").read_text())["newclient_accuracy_by_epoch"]
        assert len(by_epoch) == 5 and by_epoch[-1] == curve
        assert by_epoch[-1] > by_epoch[0] + 0.3  # a fresh head starts near chance and learns
    assert (tmp_path / "fedrep" / "plots" / "newclients.png").is_file()


@pytest.mark.parametrize("algorithm", ["fedamp", "fed_mtl", "local_only", "fedproto"])
def test_without_a_shared_model_the_held_out_clients_stay_out_and_have_no_new_client_accuracy(tmp_path, algorithm):
    overrides = (f"wandb.enabled=false out_dir={tmp_path} rounds=2 compare=[] algorithm={algorithm} data.num_clients=10 "
                 "data.num_new_clients=3 train.fraction=1.0")
    grid = LocalGrid(10, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    reached = {int(grid.contexts[m.metadata.dst_node_id].node_config["partition-id"]) for m in grid.sent
               if m.metadata.message_type != "query.info"}  # the start-up query that maps nodes to partitions
    assert reached == set(range(7))  # every training client, and no held-out one
    assert summary["status"] == "completed" and "newclient_accuracy" not in summary
    assert summary["personalized_accuracy"] > 0.5


def test_new_client_classes_are_validated():
    from flower_app.run.config import validate_with_data

    with pytest.raises(ConfigError, match="data.new_client_classes"):
        validate_with_data(load_config("quickstart", ["data.num_new_clients=2", "data.new_client_classes=[3,42]"]))
    with pytest.raises(ConfigError, match="data.num_new_clients"):
        validate_with_data(load_config("quickstart", ["data.new_client_classes=[3]"]))


@pytest.mark.parametrize("algorithm", ["fedper", "fedrep"])
def test_finetune_starts_from_the_clients_own_head_and_moves_only_it(algorithm):
    from protocols.finetune import finetune

    rt = make_runtime(algorithm, ["finetune.enabled=true", "finetune.epochs=5"])
    with torch.no_grad():  # the client's own head differs from the global model's
        rt.model.fc2.weight.add_(torch.randn_like(rt.model.fc2.weight))
    fedrep.keep_head(rt)
    own_head = rt.model.fc2.weight.clone()
    rt.reset_model()
    global_arrays = ArrayRecord(rt.model.state_dict())
    start = global_arrays.to_torch_state_dict()
    assert not torch.equal(start["fc2.weight"], own_head)
    config = ConfigRecord({"server-round": 1})
    personalized = ALGORITHMS[algorithm].handlers["evaluate"](rt, RecordDict({ARRAYS: global_arrays, CONFIG: config}))
    out = finetune(rt, RecordDict({ARRAYS: global_arrays}))[METRICS]
    assert out["accuracy_before"] == pytest.approx(personalized[METRICS]["accuracy"])  # own head, not the global one
    tuned = rt.state[rt.state_key("finetuned-model")].to_torch_state_dict()
    assert torch.equal(tuned["fc1.1.weight"], start["fc1.1.weight"])  # the body stays
    assert not torch.equal(tuned["fc2.weight"], own_head)  # the head trained from the client's own
