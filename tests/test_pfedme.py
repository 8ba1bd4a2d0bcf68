"""pFedMe: θ's K steps descend the Moreau envelope's objective (autograd), w steps toward θ, the
client sends w and keeps θ, the server mixes with β; bad values are refused by key."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flower_app.run.config import load_config
from strategies import pfedme
from strategies.common import ARRAYS
from strategies.state_store import kept_arrays
from task.errors import ConfigError
from tests.test_fedrep import make_runtime
from tests.test_personal_models import ONE_FULL_BATCH_STEP, loss_at, message, objective_step, perturbed, run_recorded


@pytest.mark.parametrize("mu", [0.0, 0.01])
def test_theta_takes_k_envelope_steps_and_w_steps_toward_it(mu):
    lam, k, personal_lr = 3.0, 2, 0.1
    rt = make_runtime("pfedme", [*ONE_FULL_BATCH_STEP, f"pfedme.lam={lam}", f"pfedme.inner_steps={k}",
                                 f"pfedme.personal_lr={personal_lr}", f"pfedme.mu={mu}"])
    w = perturbed(rt, 0.3, 1)
    sent = pfedme.train_pfedme(rt, message(rt, w))
    theta = w
    for _ in range(k):
        theta = objective_step(rt, theta, lambda x: loss_at(rt, x) + lam / 2 * sum(((x[n] - w[n]) ** 2).sum() for n in x)
                               + mu / 2 * sum((x[n] ** 2).sum() for n in x), personal_lr)
    eta = float(rt.cfg.train.lr)
    want_w = {n: w[n] - eta * lam * (w[n] - theta[n]) for n in w}
    kept = kept_arrays(rt, pfedme.PERSONAL)
    for n in w:
        torch.testing.assert_close(kept[n], theta[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][n].numpy()), want_w[n], rtol=1e-5, atol=1e-6)


def test_the_server_mixes_its_model_and_the_average_by_beta():
    sent = {"a": np.array([1.0, 2.0], np.float32), "n": np.array(10, np.int64)}
    average = ArrayRecord({"a": Array(np.array([3.0, 6.0], np.float32)), "n": Array(np.array(13, np.int64))})
    mixed = pfedme.mix(sent, average, 2.0)
    np.testing.assert_allclose(mixed["a"].numpy(), [5.0, 10.0])
    assert mixed["a"].numpy().dtype == np.float32 and mixed["n"].numpy().dtype == np.int64
    assert int(mixed["n"].numpy()) == 16


def test_a_run_sends_w_keeps_theta_and_mixes_with_beta(tmp_path):
    grid = run_recorded("algorithm=pfedme pfedme.beta=2.0 rounds=6", tmp_path)
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    replies = [m for m in grid.replies if m.metadata.message_type == "train"]
    evaluations = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert evaluations and all(ARRAYS not in m.content or not len(m.content[ARRAYS]) for m in evaluations)
    for context in grid.contexts.values():
        kept = [v for k, v in context.state.items() if k.endswith(f"/{pfedme.PERSONAL}")]
        for record in kept:
            theta = record["fc2.weight"].numpy()
            assert not any(np.allclose(theta, m.content[ARRAYS]["fc2.weight"].numpy()) for m in [*trains, *replies])
    assert len(replies) == 18


@pytest.mark.parametrize("override, key", [("pfedme.lam=0", "pfedme.lam"), ("pfedme.inner_steps=0", "pfedme.inner_steps"),
                                           ("pfedme.personal_lr=-1", "pfedme.personal_lr"), ("pfedme.beta=0", "pfedme.beta"),
                                           ("pfedme.mu=-0.1", "pfedme.mu"),
                                           ("algorithm=pfedme pfedme.lam=30", "pfedme.lam")])
def test_a_bad_value_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", override.split())
    assert str(info.value).startswith(f"{key}:")
