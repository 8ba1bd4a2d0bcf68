"""FedDBE: one client step is the autograd step of CE + κ·MR in the model and in μ_i; the
initialization period's feature mean and the server's z̄ᵍ by hand; evaluation adds μ_i; what
crosses the wire in a real run (μ_i never does); bad values refused by key."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch.func import functional_call
from torch.nn import functional as F

from flower_app.run.config import load_config
from strategies import feddbe
from strategies.common import ARRAYS, METRICS, NUM_EXAMPLES
from strategies.state_store import keep_arrays, kept_arrays
from task.errors import ConfigError
from tests.test_fedrep import make_runtime
from tests.test_personal_models import ONE_FULL_BATCH_STEP, message, perturbed, run_recorded


def body(rt, w, x):
    return functional_call(rt.model.fc1, {k.removeprefix("fc1."): v for k, v in w.items() if k.startswith("fc1.")}, (x,))


def head(rt, w, z):
    return functional_call(rt.model.fc2, {k.removeprefix("fc2."): v for k, v in w.items() if k.startswith("fc2.")}, (z,))


def step(start: dict[str, torch.Tensor], objective, lr: float) -> dict[str, torch.Tensor]:
    """start − lr · ∇objective(start), by autograd."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    grads = torch.autograd.grad(objective(leaves), list(leaves.values()))
    return {k: start[k] - lr * g for k, g in zip(leaves, grads)}


@pytest.mark.parametrize("kept", [True, False])
def test_a_client_step_descends_ce_plus_kappa_mr_in_the_model_and_in_its_bias_memory(kept):
    kappa, m = 3.0, 0.4
    rt = make_runtime("feddbe", [*ONE_FULL_BATCH_STEP, f"feddbe.kappa={kappa}", f"feddbe.momentum={m}"])
    w = perturbed(rt, 0.2, 1)
    g = torch.Generator().manual_seed(2)
    mu = 0.3 * torch.randn(64, generator=g) if kept else torch.zeros(64)
    global_mean = torch.rand(64, generator=g)
    if kept:
        keep_arrays(rt, feddbe.MEMORY, {"mu": mu})
    content = message(rt, w)
    content[feddbe.GLOBAL_MEAN] = ArrayRecord({"mean": global_mean.clone()})
    sent = feddbe.train_dbe(rt, content)
    x, y, lr = rt.train.x, rt.train.y, float(rt.cfg.train.lr)

    def objective(v, with_mr=True):
        z = body(rt, v, x)
        running = m * z.mean(0)  # restarted at zero: (1 − m)·0 + m·mean
        mr = kappa * (0.5 * (running - global_mean) ** 2).mean() if with_mr else 0.0
        return F.cross_entropy(head(rt, v, z + v["mu"]), y) + mr

    want = step({**w, "mu": mu}, objective, lr)
    for k in w:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept_arrays(rt, feddbe.MEMORY)["mu"], want["mu"], rtol=1e-5, atol=1e-6)
    assert set(sent[ARRAYS]) == set(rt.model.state_dict())  # the whole model goes back, μ_i does not
    ce_only = step({**w, "mu": mu}, lambda v: objective(v, with_mr=False), lr)
    assert (ce_only["fc1.1.weight"] - want["fc1.1.weight"]).abs().max() > 1e-4  # MR moves the body: the check can fail
    assert (want["mu"] - mu).abs().max() > 1e-4
    assert sent[METRICS]["mr_loss"] == pytest.approx(
        float(kappa * (0.5 * (m * body(rt, w, x).mean(0) - global_mean) ** 2).mean()), rel=1e-5)


def test_the_initialization_period_sends_the_running_mean_of_ce_training_and_keeps_nothing():
    """Two full-batch steps of CE alone from w0: z̄ = (1 − m)·m·mean z(w0) + m·mean z(w1)."""
    m = 0.3
    rt = make_runtime("feddbe", [*ONE_FULL_BATCH_STEP, "train.local_steps=2", f"feddbe.momentum={m}"])
    w0 = perturbed(rt, 0.2, 3)
    out = feddbe.feature_mean(rt, message(rt, w0))
    x, y, lr = rt.train.x, rt.train.y, float(rt.cfg.train.lr)
    w1 = step(w0, lambda v: F.cross_entropy(head(rt, v, body(rt, v, x)), y), lr)
    want = (1 - m) * m * body(rt, w0, x).mean(0) + m * body(rt, w1, x).mean(0)
    torch.testing.assert_close(torch.as_tensor(out[feddbe.CLIENT_MEAN]["mean"].numpy()), want.detach(),
                               rtol=1e-5, atol=1e-6)
    assert set(out.array_records) == {feddbe.CLIENT_MEAN} and float(out[METRICS][NUM_EXAMPLES]) == 40
    assert len(rt.state) == 0


def test_evaluation_adds_the_bias_memory_to_the_features_of_the_received_model():
    rt = make_runtime("feddbe")
    w = perturbed(rt, 0.5, 4)
    plain = feddbe.evaluate_dbe(rt, message(rt, w))[METRICS]  # no μ_i yet: the received model itself
    rt.model.load_state_dict(w)
    assert plain["loss"] == pytest.approx(rt.evaluate_local()["loss"], rel=1e-6)
    mu = torch.randn(64, generator=torch.Generator().manual_seed(5))
    keep_arrays(rt, feddbe.MEMORY, {"mu": mu})
    scores = feddbe.evaluate_dbe(rt, message(rt, w))[METRICS]
    out = head(rt, w, body(rt, w, rt.test.x) + mu)
    assert scores["loss"] == pytest.approx(float(F.cross_entropy(out, rt.test.y)), rel=1e-5)
    assert scores["accuracy"] == pytest.approx(float((out.argmax(1) == rt.test.y).float().mean()))
    assert scores["loss"] != pytest.approx(plain["loss"], rel=1e-3)
    assert rt.model(rt.test.x).shape == (20, 10) and not rt.model.fc2._forward_pre_hooks  # the hook is gone


def test_the_global_mean_weighs_each_clients_mean_by_its_training_examples():
    means, counts = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, -2.0]), torch.tensor([0.5, 0.0])], [10, 30, 60]
    replies = []
    for mean, n in zip(means, counts):
        content = RecordDict({METRICS: MetricRecord({NUM_EXAMPLES: float(n)}),
                              feddbe.CLIENT_MEAN: ArrayRecord({"mean": mean})})
        replies.append(Message(content, dst_node_id=1, message_type=feddbe.MEAN_QUERY))
    want = torch.tensor([(10 * 1 + 30 * 4 + 60 * 0.5) / 100, (10 * 2 - 30 * 2) / 100])
    torch.testing.assert_close(feddbe.weighted_mean(replies), want)


def test_a_run_shares_the_model_and_one_mean_per_client_and_keeps_every_bias_memory(tmp_path):
    grid = run_recorded("algorithm=feddbe", tmp_path)
    kinds = [m.metadata.message_type for m in grid.sent]
    queries = [m for m in grid.replies if m.metadata.message_type == feddbe.MEAN_QUERY]
    assert kinds.index("train") > max(i for i, k in enumerate(kinds) if k == feddbe.MEAN_QUERY)
    assert len(queries) == 6 and kinds.count(feddbe.MEAN_QUERY) == 6  # every training client, once, before round 1
    # z̄ᵍ by hand from what the clients sent, and every training message carries it
    counts = np.array([float(r.content[METRICS][NUM_EXAMPLES]) for r in queries])
    means = np.stack([r.content[feddbe.CLIENT_MEAN]["mean"].numpy() for r in queries]).astype(np.float64)
    want = (counts[:, None] * means).sum(0) / counts.sum()
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(trains) == 4 * 3
    for msg in trains:
        np.testing.assert_allclose(msg.content[feddbe.GLOBAL_MEAN]["mean"].numpy(), want, rtol=1e-6)
    keys = set(load_model_keys())
    for rep in grid.replies:
        kind = rep.metadata.message_type
        want_records = {"train": {ARRAYS}, feddbe.MEAN_QUERY: {feddbe.CLIENT_MEAN}}.get(kind, set())
        assert set(rep.content.array_records) == want_records, kind
        if kind == "train":
            assert set(rep.content[ARRAYS]) == keys
    memories = [ctx.state["feddbe/" + feddbe.MEMORY]["mu"].numpy() for ctx in grid.contexts.values()
                if "feddbe/" + feddbe.MEMORY in ctx.state]
    assert len(memories) >= 3 and all(np.abs(mu).max() > 0 for mu in memories)
    for msg in grid.sent + grid.replies:
        for record in msg.content.array_records.values():
            for array in record.values():
                values = array.numpy().ravel()
                for mu in memories:
                    if values.shape == mu.shape:
                        assert np.linalg.norm(values - mu) > 1e-5 * np.linalg.norm(mu), "a bias memory left its client"


def load_model_keys() -> list[str]:
    from task.learning.models import build_model

    return list(build_model("digits_mlp", (1, 8, 8), 10).state_dict())


@pytest.mark.parametrize("override, key, allowed", [
    ("feddbe.kappa=-1", "feddbe.kappa", ">= 0"),
    ("feddbe.momentum=0", "feddbe.momentum", "(0, 1]"),
    ("feddbe.momentum=1.5", "feddbe.momentum", "(0, 1]"),
])
def test_a_bad_value_is_refused_naming_its_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", f"algorithm=feddbe {override}".split())
    assert str(info.value).startswith(f"{key}:") and allowed in str(info.value)
