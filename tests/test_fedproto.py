"""FedProto: one client step is the autograd step of CE + λ·prototype pull, the local prototypes are
class means of the body features, the server's average is Eq. 6's (or the uniform one) by hand,
only prototypes cross the wire, and bad values are refused by key."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch.nn import functional as F

from flower_app.app.server_app import Experiment
from flower_app.run.config import load_config, validate_with_data
from strategies import fedproto
from strategies.common import CONFIG, METRICS, NUM_EXAMPLES
from strategies.state_store import kept_arrays
from task.errors import ConfigError
from tests.local_grid import LocalGrid
from tests.test_fedrep import make_runtime
from tests.test_personal_models import BASE, ONE_FULL_BATCH_STEP, objective_step, params

LAM = 0.7


def message(rt, prototypes=None, present=None, server_round=1) -> RecordDict:
    config = ConfigRecord({"server-round": server_round, "variant": rt.cfg.label, fedproto.NUM_CLASSES: 10})
    content = RecordDict({CONFIG: config})
    if prototypes is not None:
        content[fedproto.GLOBAL] = ArrayRecord({"prototypes": prototypes.clone(), "present": present.float()})
    return content


def features(rt, w):
    """digits_mlp's body by hand: relu(W1 x + b1)."""
    return torch.relu(rt.train.x.flatten(1) @ w["fc1.1.weight"].T + w["fc1.1.bias"])


def class_means(z, y):
    counts = torch.bincount(y, minlength=10).float()
    return torch.zeros(10, z.shape[1]).index_add_(0, y, z) / counts.clamp(min=1)[:, None], counts


@pytest.mark.parametrize("when", ["during_training", "after_training"])
def test_one_step_descends_ce_plus_the_pull_and_sends_the_class_means(when):
    rt = make_runtime("fedproto", [*ONE_FULL_BATCH_STEP, f"fedproto.lam={LAM}", f"fedproto.prototypes={when}"])
    start, y, lr = params(rt.model), rt.train.y, float(rt.cfg.train.lr)
    protos = torch.randn(10, 64, generator=torch.Generator().manual_seed(3))
    present = torch.arange(10) % 3 != 0  # classes 0, 3, 6, 9 have no global prototype
    assert (~present[y]).any() and present[y].any()
    sent = fedproto.train_fedproto(rt, message(rt, protos, present))

    def ce(w):
        return F.cross_entropy(features(rt, w) @ w["fc2.weight"].T + w["fc2.bias"], y)

    def objective(w):  # samples without a prototype add zero but count in the mean, as MSELoss there
        z = features(rt, w)
        return ce(w) + LAM * ((z - protos[y]) ** 2)[present[y]].sum() / z.numel()

    want = objective_step(rt, start, objective, lr)
    kept = kept_arrays(rt, fedproto.MODEL)
    for k in want:
        torch.testing.assert_close(kept[k], want[k], rtol=1e-5, atol=1e-6)
    plain = objective_step(rt, start, ce, lr)
    assert max(float((plain[k] - want[k]).abs().max()) for k in want) > 1e-4  # the pull moved the step
    means, counts = class_means(features(rt, start if when == "during_training" else want).detach(), y)
    got = sent[fedproto.LOCAL]
    torch.testing.assert_close(torch.as_tensor(got["prototypes"].numpy()), means, rtol=1e-5, atol=1e-6)
    assert got["counts"].numpy().tolist() == counts.tolist()  # |D_ij|, Eq. 6's weights
    assert float(sent[METRICS]["train_loss"]) == pytest.approx(float(objective(start)), rel=1e-5)


def test_round_one_trains_on_cross_entropy_alone_and_uniform_weighting_sends_presence_only():
    rt = make_runtime("fedproto", [*ONE_FULL_BATCH_STEP, "fedproto.weighting=uniform"])
    start, y = params(rt.model), rt.train.y
    sent = fedproto.train_fedproto(rt, message(rt))
    want = objective_step(rt, start, lambda w: F.cross_entropy(features(rt, w) @ w["fc2.weight"].T + w["fc2.bias"], y),
                          float(rt.cfg.train.lr))
    for k in want:
        torch.testing.assert_close(kept_arrays(rt, fedproto.MODEL)[k], want[k], rtol=1e-5, atol=1e-6)
    held = (torch.bincount(y, minlength=10) > 0).float()
    assert sent[fedproto.LOCAL]["counts"].numpy().tolist() == held.tolist()


def test_evaluation_predicts_the_nearest_global_prototype_and_reports_the_head_apart():
    rt = make_runtime("fedproto")
    z = features(rt, params(rt.model)).detach()
    test_z = torch.relu(rt.test.x.flatten(1) @ rt.model.fc1[1].weight.T + rt.model.fc1[1].bias).detach()
    means, _ = class_means(z, rt.train.y)
    distances = torch.cdist(test_z, means)
    absent = int(torch.mode(distances.argmin(1)).values)  # the class most test samples lie nearest: masked
    present = torch.arange(10) != absent
    scores = fedproto.evaluate_fedproto(rt, message(rt, means, present))[METRICS]
    distances[:, absent] = float("inf")
    assert float(scores["accuracy"]) == pytest.approx(float((distances.argmin(1) == rt.test.y).float().mean()))
    assert float(scores[fedproto.HEAD_ACCURACY]) == pytest.approx(rt.evaluate_local()["accuracy"])


def reply_of(prototypes, counts) -> Message:
    content = RecordDict({METRICS: MetricRecord({NUM_EXAMPLES: float(sum(counts)), "train_loss": 1.0}),
                          fedproto.LOCAL: ArrayRecord({"prototypes": Array(np.asarray(prototypes, np.float32)),
                                                       "counts": Array(np.asarray(counts, np.float32))})})
    return Message(content=content, dst_node_id=1, message_type="train")


P = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2) ** 1.5  # 3 clients × 4 classes × 2 features
COUNTS = [[2, 0, 1, 0], [6, 3, 0, 0], [0, 1, 1, 0]]  # class 3: nobody


@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_the_server_averages_each_class_over_the_clients_that_hold_it(weighting):
    if weighting == "examples":  # Σ_i |D_ij| C_i^(j) / N_j
        hand = [(2 * P[0, 0] + 6 * P[1, 0]) / 8, (3 * P[1, 1] + P[2, 1]) / 4, (P[0, 2] + P[2, 2]) / 2]
    else:  # the mean over the clients holding j
        hand = [(P[0, 0] + P[1, 0]) / 2, (P[1, 1] + P[2, 1]) / 2, (P[0, 2] + P[2, 2]) / 2]
    mean, present = fedproto.aggregate_prototypes(P, np.asarray(COUNTS, np.float32), weighting)
    assert present.tolist() == [True, True, True, False]
    np.testing.assert_allclose(mean[:3], np.stack(hand), rtol=1e-6)


@pytest.mark.parametrize("keep_absent", [False, True])
def test_a_class_no_reply_holds_is_dropped_or_keeps_its_last_prototype(keep_absent):
    server = fedproto.FedProtoServer("examples", keep_absent)
    server.shape = (4, 2)
    server.aggregate_train(1, [reply_of(P[i], COUNTS[i]) for i in range(3)])
    first = server.prototypes.copy()
    _, metrics = server.aggregate_train(2, [reply_of(P[2] + 1, [0, 0, 5, 0])])
    assert server.present.tolist() == ([True, True, True, False] if keep_absent else [False, False, True, False])
    np.testing.assert_allclose(server.prototypes[2], P[2, 2] + 1)
    if keep_absent:
        np.testing.assert_array_equal(server.prototypes[:2], first[:2])
    assert float(metrics["train_loss"]) == 1.0


def test_only_prototypes_cross_the_wire_and_each_round_sends_the_average_of_the_last(tmp_path):
    overrides = f"{BASE} algorithm=fedproto out_dir={tmp_path}"
    grid = LocalGrid(6, {"experiment": "quickstart", "overrides": overrides})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "completed" and summary["failed_client_replies"] == 0
    sent_by_id = {m.metadata.message_id: m for m in grid.sent}
    rounds: dict[int, list] = {}
    for rep in grid.replies:
        kind = rep.metadata.message_type
        records = {n: sorted(r) for n, r in rep.content.array_records.items()}
        assert records == ({fedproto.LOCAL: ["counts", "prototypes"]} if kind == "train" else {}), kind
        if kind == "train":
            local = rep.content[fedproto.LOCAL]
            assert local["prototypes"].shape == (10, 64) and local["counts"].shape == (10,)
            assert float(local["counts"].numpy().sum()) == float(rep.content[METRICS][NUM_EXAMPLES])
            sent = sent_by_id[rep.metadata.reply_to_message_id]
            rounds.setdefault(int(sent.content[CONFIG]["server-round"]), []).append(local)
    for msg in grid.sent:
        assert set(msg.content.array_records) <= {fedproto.GLOBAL}  # no model array ever goes down
        if msg.metadata.message_type not in ("train", "evaluate"):
            continue
        t = int(msg.content[CONFIG]["server-round"])
        last = t - 1 if msg.metadata.message_type == "train" else t  # evaluation follows round t's training
        assert (fedproto.GLOBAL in msg.content) == (last >= 1)
        if last >= 1:
            mean, present = fedproto.aggregate_prototypes(np.stack([r["prototypes"].numpy() for r in rounds[last]]),
                                                          np.stack([r["counts"].numpy() for r in rounds[last]]),
                                                          "examples")
            down = msg.content[fedproto.GLOBAL]
            np.testing.assert_allclose(down["prototypes"].numpy()[present], mean[present], rtol=1e-6)
            assert (down["present"].numpy() > 0).tolist() == present.tolist()
    key = f"fedproto/{fedproto.MODEL}"
    kept = [c.state[key] for c in grid.contexts.values() if key in c.state]
    assert kept and all(isinstance(r, ArrayRecord) for r in kept)  # the clients' own (final) models ...
    wire = [a.numpy() for m in grid.sent + grid.replies for r in m.content.array_records.values() for a in r.values()]
    for record in kept:  # ... whose values went nowhere
        for array in record.values():
            assert not any(w.shape == array.shape and np.allclose(w, array.numpy()) for w in wire)


@pytest.mark.parametrize("override, key, allowed", [
    ("fedproto.lam=-1", "fedproto.lam", ">= 0"),
    ("fedproto.weighting=counts", "fedproto.weighting", "uniform"),
    ("fedproto.prototypes=eval", "fedproto.prototypes", "after_training"),
    ("fedproto.keep_absent=maybe", "fedproto.keep_absent", "true or false"),
])
def test_a_bad_value_is_refused_naming_its_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", ["algorithm=fedproto", *override.split()])
    assert str(info.value).startswith(f"{key}:") and allowed in str(info.value)


def test_a_regression_task_is_refused():
    cfg = load_config("quickstart", ["algorithm=fedproto", "data.name=synthetic_linear", "model.name=linear_rep",
                                     "data.partition=natural"])
    with pytest.raises(ConfigError) as info:
        validate_with_data(cfg)
    assert str(info.value).startswith("algorithm:") and "regression" in str(info.value)
