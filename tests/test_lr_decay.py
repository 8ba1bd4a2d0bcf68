"""``train.lr_decay`` has one source of truth: every client step of round t (and +FT and the new
clients after the last round) runs at ``train.lr · lr_decay^(t−1)``.

Each check runs a client handler twice — at round 3 with lr=0.4, decay=0.5 and with lr=0.1,
decay=1 (the same rate, 0.1) — and expects identical results; code that reads the undecayed
``train.lr`` uses 0.4 in the first run and fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from flower_app.app.client_app import evaluate_global_model
from flower_app.run.config import load_config

from protocols.finetune import finetune
from protocols.new_clients import adapt_head
from strategies import ALGORITHMS
from strategies.common import ARRAYS, CONFIG, METRICS, ClientRuntime, round_lr
from strategies.lg_fedavg import _pretrain_fair
from task.learning.engine import TensorData
from task.learning.models import FairMLP
from tests.test_strategies import make_runtime

ROUND = 3
DECAYED = ["train.lr=0.4", "train.lr_decay=0.5"]
CONSTANT = ["train.lr=0.1", "train.lr_decay=1.0"]


def fair_runtime(overrides: list[str]) -> ClientRuntime:
    """A client of the LG-FedAvg fairness experiment on a small hand-made table."""
    cfg = load_config("lg_fair_adult", list(overrides))
    torch.manual_seed(0)
    model = FairMLP(5, 2, dropout=0.0)
    g = torch.Generator().manual_seed(1)

    def table(n: int) -> TensorData:
        x = torch.randn(n, 5, generator=g)
        return TensorData(x, (x[:, 0] > 0).long(), torch.stack([(x[:, 1] > 0), (x[:, 2] > 0)], 1).float())

    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return ClientRuntime(cfg, 0, torch.device("cpu"), table(40), table(20), model, ["g1", "g2", "g3"], initial)


def _run(overrides: list[str], handler, message: str = "train", extra: dict | None = None,
         runtime=make_runtime) -> dict:
    rt = runtime(overrides)
    rt.reset_model()
    content = RecordDict({ARRAYS: ArrayRecord(rt.model.state_dict()),
                          CONFIG: ConfigRecord({"server-round": ROUND, "variant": rt.cfg.label, **(extra or {})})})
    if message == "scaffold":
        content["control"] = ArrayRecord({k: v * 0 + 0.01 for k, v in rt.model.state_dict().items()
                                          if k in dict(rt.model.named_parameters())})
    out = handler(rt, content)
    result = {f"m/{k}": float(v) for k, v in out[METRICS].items()} if METRICS in out else {}
    for key in out:
        if key not in (METRICS, CONFIG):
            result.update({f"{key}/{k}": v.numpy() for k, v in out[key].to_torch_state_dict().items()})
    for name, record in rt.state.items():
        if isinstance(record, ArrayRecord):
            result.update({f"state/{name}/{k}": v.numpy() for k, v in record.items()})
    return result


def _same(a: dict, b: dict) -> None:
    assert a and a.keys() == b.keys()
    for key in a:
        assert np.allclose(a[key], b[key], rtol=1e-6, atol=1e-7), key


def test_the_client_optimizer_carries_the_train_settings():
    opt = make_runtime(["train.momentum=0.9", "train.weight_decay=0.001", "train.decay_biases=false"]).optimizer(1)
    assert (opt.momentum, opt.weight_decay, opt.decay_biases) == (0.9, 0.001, False)


def test_round_lr_is_the_decayed_rate():
    rt = make_runtime(DECAYED)
    assert round_lr(rt.cfg, 1) == pytest.approx(0.4)
    assert round_lr(rt.cfg, ROUND) == pytest.approx(0.1)
    assert rt.optimizer(ROUND).lr == pytest.approx(0.1)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep", "scaffold"])
def test_training_uses_the_rate_of_its_round(algorithm):
    handler = ALGORITHMS[algorithm].handlers["train"]
    kind = "scaffold" if algorithm == "scaffold" else "train"
    _same(_run([f"algorithm={algorithm}", *DECAYED], handler, kind),
          _run([f"algorithm={algorithm}", *CONSTANT], handler, kind))


def test_a_never_sampled_fedrep_client_fits_its_head_at_the_round_rate():
    handler = ALGORITHMS["fedrep"].handlers["evaluate"]
    _same(_run(["algorithm=fedrep", *DECAYED], handler), _run(["algorithm=fedrep", *CONSTANT], handler))


@pytest.mark.parametrize("handler,section", [(finetune, "finetune"), (adapt_head, "new_clients")])
def test_after_training_protocols_default_to_the_final_round_rate(handler, section):
    final = [f"rounds={ROUND}", "finetune.epochs=3", "new_clients.epochs=3", f"{section}.lr=null"]
    _same(_run(["algorithm=fedavg", *final, *DECAYED], handler), _run(["algorithm=fedavg", *final, *CONSTANT], handler))


def test_fair_training_and_postfit_use_the_round_rate():
    for handler, extra in ((ALGORITHMS["fedavg"].handlers["train"], {}),
                           (evaluate_global_model, {"postfit": True})):
        fair = ["algorithm=fedavg", "fair.adversarial=false", "fair.postfit_epochs=2", "train.local_epochs=2"]
        _same(_run([*fair, *DECAYED], handler, extra=extra, runtime=fair_runtime),
              _run([*fair, *CONSTANT], handler, extra=extra, runtime=fair_runtime))


def test_lg_fair_pretraining_uses_the_round_rate():
    def pretrain(rt: ClientRuntime, content: RecordDict) -> RecordDict:
        _pretrain_fair(rt, content[CONFIG])
        return RecordDict({ARRAYS: ArrayRecord(rt.model.state_dict())})

    fair = ["fair.pretrain_epochs=2"]
    _same(_run([*fair, *DECAYED], pretrain, runtime=fair_runtime), _run([*fair, *CONSTANT], pretrain, runtime=fair_runtime))
