"""FedBABU: the body takes the gradient step of the loss with the received head frozen; the server's
head stays the initial one, value for value; the clients send the body only; +FT personalizes."""

import torch

from strategies import fedbabu
from strategies.common import ARRAYS
from tests.test_fedrep import make_runtime
from tests.test_personal_models import ONE_FULL_BATCH_STEP, loss_at, message, objective_step, perturbed

HEAD = ("fc2.weight", "fc2.bias")


def test_a_client_step_is_the_bodys_gradient_step_with_the_head_frozen():
    rt = make_runtime("fedbabu", ONE_FULL_BATCH_STEP)
    model = perturbed(rt, 0.3, 1)
    sent = fedbabu.train_fedbabu(rt, message(rt, model))
    body = {k: v for k, v in model.items() if k not in HEAD}
    head = {k: model[k] for k in HEAD}
    want = objective_step(rt, body, lambda b: loss_at(rt, {**b, **head}), float(rt.cfg.train.lr))
    assert sorted(sent[ARRAYS]) == sorted(body)
    for k in body:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)
    for k in HEAD:
        assert torch.equal(rt.model.state_dict()[k], head[k])


def test_the_servers_head_stays_the_initial_one_and_only_bodies_come_back(tmp_path):
    from flower_app.app.server_app import Experiment
    from flower_app.run.config import load_config
    from tests.local_grid import LocalGrid
    from tests.test_personal_models import BASE

    overrides = f"{BASE} algorithm=fedbabu finetune.enabled=true finetune.part=full finetune.epochs=2 out_dir={tmp_path}"
    grid = LocalGrid(6, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, load_config("quickstart", overrides.split()))
    start = {k: a.numpy().copy() for k, a in experiment.arrays.items()}
    summary = experiment.run()
    assert summary["status"] == "completed" and summary["failed_client_replies"] == 0
    end = {k: a.numpy() for k, a in experiment.arrays.items()}
    assert all((end[k] == start[k]).all() for k in HEAD)
    assert (end["fc1.1.weight"] != start["fc1.1.weight"]).any()  # the body learns
    up = [m.content[ARRAYS] for m in grid.replies if m.metadata.message_type == "train"]
    assert len(up) == 12 and all(sorted(a) == ["fc1.1.bias", "fc1.1.weight"] for a in up)
    finetune = [m.content["metrics"] for m in grid.replies if m.metadata.message_type == "train.finetune"]
    assert len(finetune) == 6
    assert sum(m["accuracy_after"] for m in finetune) > sum(m["accuracy_before"] for m in finetune)
