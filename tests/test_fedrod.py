"""FedRoD: the model's step is the balanced softmax's gradient step, the personal head's is the
gradient of CE(g(z) + p(z)) with z and g(z) detached; the personal head never leaves the client and
evaluation scores g + p."""

import math

import torch
from torch.func import functional_call
from torch.nn import functional as F

from strategies import fedrod
from strategies.common import ARRAYS
from strategies.state_store import keep_arrays, kept_arrays
from tests.test_fedrep import make_runtime
from tests.test_personal_models import ONE_FULL_BATCH_STEP, message, objective_step, perturbed, run_recorded

HEAD = ("fc2.weight", "fc2.bias")


def test_the_balanced_softmax_adds_the_log_class_counts():
    logits, y, counts = torch.tensor([[0.5, 1.0, -1.0]]), torch.tensor([0]), torch.tensor([4, 1, 0])
    want = -torch.log_softmax(torch.tensor([0.5 + math.log(4), 1.0, -math.inf]), 0)[0]
    torch.testing.assert_close(fedrod.balanced_softmax_loss(logits, y, counts), want)


def test_a_client_step_is_the_generic_models_and_the_personal_heads_gradient_step():
    rt = make_runtime("fedrod", ONE_FULL_BATCH_STEP)
    w = perturbed(rt, 0.3, 1)
    p = {k: v + 0.5 for k, v in perturbed(rt, 0.3, 2).items() if k in HEAD}
    keep_arrays(rt, fedrod.PERSONAL_HEAD, p)
    sent = fedrod.train_fedrod(rt, message(rt, w))
    lr = float(rt.cfg.train.lr)
    counts = torch.bincount(rt.train.y, minlength=10)
    want_w = objective_step(rt, w, lambda x: fedrod.balanced_softmax_loss(
        functional_call(rt.model, x, (rt.train.x,)), rt.train.y, counts), lr)
    with torch.no_grad():
        z = torch.relu(F.linear(rt.train.x.flatten(1), w["fc1.1.weight"], w["fc1.1.bias"]))
        generic = F.linear(z, w["fc2.weight"], w["fc2.bias"])
    want_p = objective_step(rt, p, lambda q: F.cross_entropy(generic + F.linear(z, q["fc2.weight"], q["fc2.bias"]),
                                                             rt.train.y), lr)
    for k in w:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want_w[k], rtol=1e-5, atol=1e-6)
    kept = kept_arrays(rt, fedrod.PERSONAL_HEAD)
    assert sorted(kept) == sorted(HEAD)
    for k in HEAD:
        torch.testing.assert_close(kept[k], want_p[k], rtol=1e-5, atol=1e-6)


def test_evaluation_scores_the_generic_plus_the_personal_head():
    rt = make_runtime("fedrod")
    w = perturbed(rt, 0.3, 3)
    p = {k: v * 2 for k, v in perturbed(rt, 0.3, 4).items() if k in HEAD}
    keep_arrays(rt, fedrod.PERSONAL_HEAD, p)
    metrics = fedrod.evaluate_fedrod(rt, message(rt, w))["metrics"]
    with torch.no_grad():
        z = torch.relu(F.linear(rt.test.x.flatten(1), w["fc1.1.weight"], w["fc1.1.bias"]))
        out = F.linear(z, w["fc2.weight"], w["fc2.bias"]) + F.linear(z, p["fc2.weight"], p["fc2.bias"])
    assert metrics["accuracy"] == float((out.argmax(1) == rt.test.y).float().mean())
    assert math.isclose(metrics["loss"], float(F.cross_entropy(out, rt.test.y)), rel_tol=1e-5)


def test_no_personal_head_crosses_the_wire(tmp_path):
    grid = run_recorded("algorithm=fedrod", tmp_path)
    wire = [m.content[ARRAYS] for m in [*grid.sent, *grid.replies] if ARRAYS in m.content and len(m.content[ARRAYS])]
    kept = [v for c in grid.contexts.values() for k, v in c.state.items() if k.endswith(f"/{fedrod.PERSONAL_HEAD}")]
    assert wire and len(kept) >= 3
    for record in kept:
        head = record["fc2.weight"].numpy()
        assert not any(torch.allclose(torch.as_tensor(head), torch.as_tensor(a["fc2.weight"].numpy()), rtol=1e-5)
                       for a in wire if "fc2.weight" in a)
