"""Algorithms: client halves against centralized SGD, server halves' aggregation, wire contents."""

import copy

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch.nn import functional as F

from flower_app.run.config import load_config
from flower_app.app.federation import NodeSubset, Traffic, exchange, payload_size
from strategies import ALGORITHMS
from strategies.common import ARRAYS, CONFIG, METRICS, ClientRuntime, reply
from protocols.finetune import SALT, finetune
from task.errors import ConfigError
from task.learning.engine import TensorData, train
from task.learning.models import build_model


def make_runtime(overrides=(), n=20, seed=0):
    cfg = load_config("quickstart", list(overrides))
    torch.manual_seed(cfg.seed)
    model = build_model("digits_mlp", (1, 8, 8), 10)
    g = torch.Generator().manual_seed(seed)
    train = TensorData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))
    test = TensorData(torch.randn(10, 1, 8, 8, generator=g), torch.randint(0, 10, (10,), generator=g))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return ClientRuntime(cfg, 0, torch.device("cpu"), train, test, model, ["fc2"], initial)


def train_message(rt, arrays, server_round=1, **config):
    cfg = ConfigRecord({"server-round": server_round, "lr": float(rt.cfg.train.lr), **config})
    return RecordDict({ARRAYS: arrays, CONFIG: cfg})


def test_fedavg_one_client_one_step_equals_centralized_sgd():
    rt = make_runtime(["train.local_steps=1", "train.batch_size=20", "train.momentum=0.9", "train.lr=0.1"])
    global_model = copy.deepcopy(rt.model)
    arrays = ArrayRecord(global_model.state_dict())
    strategy = ALGORITHMS["fedavg"].make_strategy(rt.cfg)
    out_msg = Message(train_message(rt, arrays), dst_node_id=1, message_type="train")
    client_reply = Message(ALGORITHMS["fedavg"].handlers["train"](rt, out_msg.content), reply_to=out_msg)
    aggregated, _ = strategy.aggregate_train(1, [client_reply])

    reference = copy.deepcopy(global_model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    F.cross_entropy(reference(rt.train.x), rt.train.y).backward()
    opt.step()
    for key, value in reference.state_dict().items():
        np.testing.assert_allclose(aggregated[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-7)


def test_fedavg_aggregation_is_weighted_by_examples():
    strategy = ALGORITHMS["fedavg"].make_strategy(load_config("quickstart"))
    out = Message(RecordDict({CONFIG: ConfigRecord()}), dst_node_id=1, message_type="train")
    a = reply(ArrayRecord({"w": torch.full((3,), 1.0)}), **{"num-examples": 10})
    b = reply(ArrayRecord({"w": torch.full((3,), 5.0)}), **{"num-examples": 30})
    aggregated, _ = strategy.aggregate_train(1, [Message(a, reply_to=out), Message(b, reply_to=out)])
    np.testing.assert_allclose(aggregated["w"].numpy(), np.full(3, (10 * 1 + 30 * 5) / 40))



@pytest.mark.parametrize("overrides", [[], ["server_opt.name=fedavgm", "server_opt.momentum=0.0"], ["algorithm=fedprox"]])
def test_uniform_aggregation_weighs_every_reply_alike(overrides):
    cfg = load_config("quickstart", ["algorithm=fedavg", "train.aggregation=uniform", *overrides])
    strategy = ALGORITHMS[cfg.algorithm].make_strategy(cfg)
    out = Message(RecordDict({CONFIG: ConfigRecord()}), dst_node_id=1, message_type="train")
    start = ArrayRecord({"w": torch.zeros(3)})
    list(strategy.configure_train(1, start, ConfigRecord(), NodeSubset(None, [11])))  # FedAvgM's current arrays
    a = reply(ArrayRecord({"w": torch.full((3,), 1.0)}), train_loss=1.0, **{"num-examples": 10})
    b = reply(ArrayRecord({"w": torch.full((3,), 5.0)}), train_loss=3.0, **{"num-examples": 30})
    aggregated, metrics = strategy.aggregate_train(1, [Message(a, reply_to=out), Message(b, reply_to=out)])
    np.testing.assert_allclose(aggregated["w"].numpy(), np.full(3, 3.0))
    assert metrics["train_loss"] == pytest.approx(2.0)

def test_fedprox_server_sends_mu_and_client_uses_it():
    cfg = load_config("quickstart", ["algorithm=fedprox", "fedprox.mu=0.7"])
    strategy = ALGORITHMS["fedprox"].make_strategy(cfg)
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeSubset(None, [11, 12])))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 12]
    assert msgs[0].content[CONFIG]["proximal-mu"] == pytest.approx(0.7)
    # the client result depends on mu
    results = []
    for mu in (0.0, 5.0):
        rt = make_runtime(["train.local_epochs=3"])
        arrays = ArrayRecord(rt.model.state_dict())
        results.append(ALGORITHMS["fedprox"].handlers["train"](rt, train_message(rt, arrays, **{"proximal-mu": mu}))[ARRAYS])
    assert not np.allclose(results[0]["fc1.1.weight"].numpy(), results[1]["fc1.1.weight"].numpy())


def test_fedprox_client_puts_the_pull_where_the_server_says():
    cfg = load_config("quickstart", ["algorithm=fedprox", "fedprox.pull=after_momentum"])
    msgs = list(ALGORITHMS["fedprox"].make_strategy(cfg).configure_train(1, ArrayRecord(), ConfigRecord(),
                                                                          NodeSubset(None, [11])))
    assert msgs[0].content[CONFIG]["proximal-pull"] == "after_momentum"
    results = []
    for pull in ("gradient", "after_momentum"):
        rt = make_runtime(["train.local_epochs=3", "train.momentum=0.5"])
        arrays = ArrayRecord(rt.model.state_dict())
        message = train_message(rt, arrays, **{"proximal-mu": 5.0, "proximal-pull": pull})
        results.append(ALGORITHMS["fedprox"].handlers["train"](rt, message)[ARRAYS])
    assert not np.allclose(results[0]["fc1.1.weight"].numpy(), results[1]["fc1.1.weight"].numpy())


def test_local_only_sends_no_arrays_and_keeps_its_model():
    rt = make_runtime(["algorithm=local_only"])
    strategy = ALGORITHMS["local_only"].make_strategy(rt.cfg)
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"lr": 0.05}), NodeSubset(None, [5])))
    assert payload_size(msgs[0].content) == (0, 0)
    content = ALGORITHMS["local_only"].handlers["train"](rt, msgs[0].content)
    assert payload_size(content) == (0, 0)
    kept = rt.state[rt.state_key("local-model")]["fc1.1.weight"].numpy()
    assert not np.allclose(kept, rt.initial_state["fc1.1.weight"].numpy())
    rt.reset_model()  # evaluation must use the kept model, not whatever the model object holds
    metrics = ALGORITHMS["local_only"].handlers["evaluate"](rt, RecordDict())[METRICS]
    rt.load(rt.state[rt.state_key("local-model")])
    assert metrics["accuracy"] == pytest.approx(rt.evaluate_local()["accuracy"])


def test_finetune_reports_before_and_after_and_moves_only_the_head():
    rt = make_runtime(["algorithm=fedavg", "finetune.enabled=true", "finetune.epochs=20", "finetune.part=head"])
    arrays = ArrayRecord(rt.model.state_dict())
    out = finetune(rt, RecordDict({ARRAYS: arrays}))[METRICS]
    assert {"accuracy_before", "accuracy_after", "num-examples"} <= set(out.keys())
    tuned = rt.state[rt.state_key("finetuned-model")]
    np.testing.assert_array_equal(tuned["fc1.1.weight"].numpy(), arrays["fc1.1.weight"].numpy())
    assert not np.allclose(tuned["fc2.weight"].numpy(), arrays["fc2.weight"].numpy())


def finetuned(overrides):
    """The model after +FT of the runtime's initial model under ``overrides``, and the model it started from."""
    rt = make_runtime(["algorithm=fedavg", "finetune.enabled=true", "finetune.epochs=5", *overrides])
    arrays = ArrayRecord(rt.model.state_dict())
    finetune(rt, RecordDict({ARRAYS: arrays}))
    assert all(p.requires_grad for p in rt.model.parameters())  # the frozen body is trainable again
    return rt.state[rt.state_key("finetuned-model")].to_torch_state_dict(), arrays.to_torch_state_dict()


def test_finetune_in_train_mode_augments_the_head_batches_and_keeps_the_body():
    """The official code's head fine-tuning: train-mode passes over augmented batches. Without
    augmentation (and no dropout) it is the eval-mode feature cache up to rounding; with it, not."""
    augmented, start = finetuned(["finetune.head_features=train_mode", "train.augment=crop_flip"])
    cached, _ = finetuned(["train.augment=crop_flip"])  # eval: features of the un-augmented images
    torch.testing.assert_close(augmented["fc1.1.weight"], start["fc1.1.weight"], rtol=0, atol=0)
    assert not torch.allclose(augmented["fc2.weight"], cached["fc2.weight"], atol=1e-3)
    plain, _ = finetuned(["finetune.head_features=train_mode"])
    torch.testing.assert_close(plain["fc2.weight"], cached["fc2.weight"], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="finetune.head_features"):
        load_config("quickstart", ["finetune.head_features=train_mode", "finetune.part=full"])


def test_full_finetune_trains_every_layer_on_augmented_batches_as_local_training():
    """finetune.part=full: the whole model, train mode, train.augment on every batch (the
    official FedRep code's last round for FedAvg/FedProx): the same steps as engine.train."""
    tuned, start = finetuned(["finetune.part=full", "train.augment=crop_flip"])
    assert not torch.allclose(tuned["fc1.1.weight"], start["fc1.1.weight"])  # the body moves too
    rt = make_runtime(["algorithm=fedavg", "finetune.enabled=true", "finetune.epochs=5", "train.augment=crop_flip"])
    rt.model.load_state_dict(start)
    rounds = int(rt.cfg.rounds)
    train(rt.model, rt.train, rt.optimizer(rounds), int(rt.cfg.train.batch_size), rt.generator(rounds + 1, SALT),
          epochs=5, augment="crop_flip")
    for name, value in rt.model.state_dict().items():
        torch.testing.assert_close(tuned[name], value, rtol=0, atol=0)
    plain, _ = finetuned(["finetune.part=full"])
    assert not torch.allclose(plain["fc1.1.weight"], tuned["fc1.1.weight"], atol=1e-4)


def test_local_only_finetune_trains_the_clients_own_model_further():
    """Local-only +FT (the official FedRep --alg maml final round): it starts from the client's
    own kept model, not the received (empty) arrays, and trains every layer of it."""
    rt = make_runtime(["algorithm=local_only", "finetune.enabled=true", "finetune.part=full", "finetune.epochs=5"])
    handlers = ALGORITHMS["local_only"].handlers
    handlers["train"](rt, train_message(rt, ArrayRecord()))
    own = {k: v.clone() for k, v in rt.model.state_dict().items()}
    assert not torch.equal(own["fc2.weight"], rt.initial_state["fc2.weight"])
    rt.reset_model()  # as a fresh message finds it
    initial_loss = rt.evaluate_local()["loss"]
    before = handlers["evaluate"](rt, RecordDict({CONFIG: ConfigRecord({"server-round": 1})}))[METRICS]
    rt.reset_model()
    out = finetune(rt, RecordDict({ARRAYS: ArrayRecord()}))[METRICS]
    assert before["loss"] != pytest.approx(initial_loss, rel=1e-3)
    assert out["loss_before"] == pytest.approx(before["loss"], rel=1e-6)  # the own model, not the initial one
    tuned = rt.state[rt.state_key("finetuned-model")].to_torch_state_dict()
    assert all(not torch.equal(tuned[k], own[k]) for k in ("fc1.1.weight", "fc2.weight"))
    kept = rt.state[rt.state_key("local-model")].to_torch_state_dict()
    assert all(torch.equal(kept[k], own[k]) for k in own)  # the kept model itself is unchanged


@pytest.mark.parametrize("pull", ["gradient", "after_momentum"])
def test_full_finetune_with_the_proximal_term_is_local_training_with_fedprox_pull(pull):
    """finetune.prox_mu (the official FedRep code's FedProx+FT keeps its FedProx optimizer): the
    same steps as engine.train with that pull toward the received model, which stays closer."""
    settings = ["finetune.part=full", "train.momentum=0.5", f"finetune.prox_pull={pull}"]
    pulled, start = finetuned([*settings, "finetune.prox_mu=5"])
    rt = make_runtime(["algorithm=fedavg", "finetune.enabled=true", "finetune.epochs=5", "train.momentum=0.5"])
    rt.model.load_state_dict(start)
    rounds = int(rt.cfg.rounds)
    train(rt.model, rt.train, rt.optimizer(rounds), int(rt.cfg.train.batch_size), rt.generator(rounds + 1, SALT),
          epochs=5, prox_mu=5.0, prox_pull=pull)
    for name, value in rt.model.state_dict().items():
        torch.testing.assert_close(pulled[name], value, rtol=0, atol=0)
    free, _ = finetuned(settings)
    key = "fc1.1.weight"
    assert (pulled[key] - start[key]).norm() < 0.9 * (free[key] - start[key]).norm()


def test_the_finetune_proximal_term_needs_full_finetuning():
    with pytest.raises(ConfigError, match="finetune.prox_mu"):
        load_config("quickstart", ["finetune.prox_mu=1", "finetune.part=head"])
    with pytest.raises(ConfigError, match="finetune.prox_pull"):
        load_config("quickstart", ["finetune.prox_mu=1", "finetune.part=full", "finetune.prox_pull=before"])


class FakeGrid:
    """Replies from a function of the message; ``None`` drops the reply."""

    def __init__(self, answer):
        self.answer = answer

    def push_messages(self, messages):
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{i}"
        self.replies = [r for r in (self.answer(m) for m in messages) if r is not None]
        return [r.metadata.reply_to_message_id for r in self.replies]

    def pull_messages(self, message_ids):
        return [r for r in self.replies if r.metadata.reply_to_message_id in set(message_ids)]


def test_failed_clients_are_logged_and_left_out_of_the_aggregate():
    from flower_app.app.federation import Federation

    fed = Federation({0: 100, 1: 101, 2: 102})

    def answer(msg):
        node = msg.metadata.dst_node_id
        if node == 101:
            return _error_reply(msg)
        if node == 102:
            return None
        return Message(reply(ArrayRecord({"w": torch.ones(2)}), **{"num-examples": 4}), reply_to=msg)

    msgs = [Message(RecordDict({CONFIG: ConfigRecord()}), dst_node_id=n, message_type="train") for n in (100, 101, 102)]
    good, failed = exchange(FakeGrid(answer), msgs, Traffic(), fed, "train")
    assert list(failed) == [1, 2] and failed[1].startswith("error") and failed[2] == "no reply"
    aggregated, _ = ALGORITHMS["fedavg"].make_strategy(load_config("quickstart")).aggregate_train(1, good)
    np.testing.assert_allclose(aggregated["w"].numpy(), np.ones(2))


def _error_reply(msg):
    from flwr.app import Error

    return Message(Error(code=0, reason="client crashed"), reply_to=msg)


def test_server_optimizers_are_selectable_and_change_the_update():
    from flwr.serverapp.strategy import FedAdam, FedAvgM

    m = ALGORITHMS["fedavg"].make_strategy(load_config("quickstart", ["algorithm=fedavg", "server_opt.name=fedavgm", "server_opt.lr=1.0", "server_opt.momentum=0.9"]))
    a = ALGORITHMS["fedavg"].make_strategy(load_config("quickstart", ["algorithm=fedavg", "server_opt.name=fedadam", "server_opt.lr=0.01"]))
    assert isinstance(m, FedAvgM) and m.server_momentum == 0.9
    assert isinstance(a, FedAdam) and a.eta == 0.01
    start = ArrayRecord({"w": torch.zeros(2)})
    out = Message(RecordDict({CONFIG: ConfigRecord()}), dst_node_id=1, message_type="train")
    list(m.configure_train(1, start, ConfigRecord(), NodeSubset(None, [1])))
    first, _ = m.aggregate_train(1, [Message(reply(ArrayRecord({"w": torch.ones(2)}), **{"num-examples": 1}), reply_to=out)])
    list(m.configure_train(2, first, ConfigRecord(), NodeSubset(None, [1])))
    second, _ = m.aggregate_train(2, [Message(reply(ArrayRecord({"w": torch.full((2,), 2.0)}), **{"num-examples": 1}), reply_to=out)])
    # heavy-ball: v1 = -1, x1 = 1; v2 = 0.9 * v1 + (x1 - 2) = -1.9, x2 = x1 - v2 = 2.9
    np.testing.assert_allclose(second["w"].numpy(), np.full(2, 2.9), rtol=1e-6)
