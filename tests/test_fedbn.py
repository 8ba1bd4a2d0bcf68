"""FedBN: a client step is plain SGD of the whole model; its batch-norm layers (weights, biases,
running statistics) stay on the client, the rest is averaged; models without batch norm are refused;
integer buffers keep their dtype through Flower's average."""

import numpy as np
import pytest
import torch

from flower_app.run.config import load_config
from strategies import fedbn
from strategies.common import ARRAYS
from strategies.state_store import kept_arrays
from task.errors import ConfigError
from task.learning.models import build_model
from tests.test_fedrep import make_runtime
from tests.test_personal_models import ONE_FULL_BATCH_STEP, loss_at, message, objective_step, params, run_recorded

BN_MODEL = "model.name=digits_mlp_bn"


def bn_runtime():
    return make_runtime("fedbn", [*ONE_FULL_BATCH_STEP, BN_MODEL], model=build_model("digits_mlp_bn", (1, 8, 8), 10))


def test_the_batch_norm_keys_are_the_bn_layers_and_nothing_else():
    model = build_model("fedrep_cnn_bn", (3, 32, 32), 10)
    local = fedbn.batch_norm_keys(model)
    assert local == [f"{g}.{i}.{n}" for g, i in (("conv1", 1), ("conv2", 1), ("fc1", 2), ("fc2", 1))
                     for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
    assert fedbn.shared_keys(model, None) == [k for k in model.state_dict() if k not in local]
    assert fedbn.batch_norm_keys(build_model("fedrep_cnn", (3, 32, 32), 10)) == []


def test_a_client_step_is_sgd_of_the_whole_model_and_it_keeps_its_bn_layers():
    rt = bn_runtime()
    shared = fedbn.shared_keys(rt.model, rt.cfg)
    g = torch.Generator().manual_seed(3)
    received = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in params(rt.model).items() if k in shared}
    own_bn = {"fc1.2.weight": torch.full((64,), 1.5), "fc1.2.bias": torch.full((64,), 0.2)}
    fedbn.keep_arrays(rt, fedbn.BN_STATE, {**{k: rt.model.state_dict()[k] for k in fedbn.batch_norm_keys(rt.model)},
                                           **own_bn})
    sent = fedbn.train_fedbn(rt, message(rt, received))
    start = {**received, **own_bn}
    want = objective_step(rt, start, lambda w: loss_at(rt, w), float(rt.cfg.train.lr))
    assert sorted(sent[ARRAYS]) == sorted(shared)
    for k in received:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)
    kept = kept_arrays(rt, fedbn.BN_STATE)
    for k in own_bn:
        torch.testing.assert_close(kept[k], want[k], rtol=1e-5, atol=1e-6)
    assert int(kept["fc1.2.num_batches_tracked"]) == 1 and kept["fc1.2.running_mean"].abs().sum() > 0


def test_no_bn_value_crosses_and_fedavg_keeps_the_integer_buffers(tmp_path):
    grid = run_recorded(f"algorithm=fedbn {BN_MODEL} rounds=12 eval.every=4", tmp_path / "fedbn")
    local = set(fedbn.batch_norm_keys(build_model("digits_mlp_bn", (1, 8, 8), 10)))
    arrays = [m.content[ARRAYS] for m in [*grid.sent, *grid.replies] if ARRAYS in m.content]
    assert arrays and all(not local & set(a) for a in arrays)
    kept = [kept_arrays_of(grid, node) for node in grid.node_ids]
    means = [k["fc1.2.running_mean"] for k in kept if k is not None]
    assert len(means) >= 2 and not torch.equal(means[0], means[1])  # each client's own statistics
    fedavg = run_recorded(f"algorithm=fedavg {BN_MODEL} rounds=12 eval.every=4", tmp_path / "fedavg")
    down = [m.content[ARRAYS] for m in fedavg.sent if m.metadata.message_type == "train"]
    assert down[-1]["fc1.2.num_batches_tracked"].numpy().dtype == np.int64
    assert int(down[-1]["fc1.2.num_batches_tracked"].numpy()) > 0


def kept_arrays_of(grid, node):
    state = grid.contexts[node].state
    key = next((k for k in state if k.endswith(f"/{fedbn.BN_STATE}")), None)
    return None if key is None else state[key].to_torch_state_dict()


def test_a_model_without_batch_norm_is_refused_naming_the_model(tmp_path):
    from flower_app.app.server_app import Experiment
    from tests.local_grid import LocalGrid

    overrides = f"wandb.enabled=false compare=[] algorithm=fedbn out_dir={tmp_path}"
    with pytest.raises(ConfigError, match=r"^model.name: fedbn keeps the batch-norm layers local and 'digits_mlp'"):
        Experiment(LocalGrid(2, {"experiment": "quickstart", "overrides": overrides}),
                   load_config("quickstart", overrides.split()))
