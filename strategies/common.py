"""What every algorithm's client half works with, and helpers shared by the algorithms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from omegaconf import DictConfig

from task.learning.engine import OptimizerConfig, TensorData, TrainResult, seeded_generator, train
from task.learning.inference import evaluate
from task.learning.split_model import SplitModel

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
NUM_EXAMPLES = "num-examples"
VALIDATION_ACCURACY = "validation_accuracy"  # an evaluation reply's accuracy on the validation part


class ModelTraining(Protocol):
    """A model's own local objective, from a paper protocol (:meth:`protocols.base.PaperProtocol.client_training`):
    it replaces plain SGD in :meth:`ClientRuntime.local_training` and adds to its test metrics."""

    def train(self, rt: ClientRuntime, config: ConfigRecord, lr: float | None, salt: int) -> TrainResult:
        """The configured local epochs of the whole model under this objective."""

    def test_metrics(self, rt: ClientRuntime, config: ConfigRecord | None) -> dict[str, float]:
        """Metrics of the current model on ``rt.test`` beyond loss and accuracy."""


@dataclass
class ClientRuntime:
    """One client's view of a run: its config, data on the device, a model and its state.

    The model object is reused across messages in a worker process; an algorithm must
    load every parameter it relies on (from the message or from ``state``) before use.
    """

    cfg: DictConfig
    partition_id: int
    device: torch.device
    train: TensorData
    test: TensorData
    model: SplitModel
    head: list[str]
    initial_state: dict[str, torch.Tensor]
    regression: bool = False
    state: RecordDict = field(default_factory=RecordDict)
    run_id: int = 0
    node_id: int = 0
    state_dir: str | None = None  # the node config's state-dir: all state on disk, surviving restarts
    validation: TensorData | None = None  # the held-out part of the training data (data.validation_fraction)
    model_training: ModelTraining | None = None  # a protocol's own local objective (e.g. the fair model's), else SGD

    def optimizer(self, server_round: int, lr: float | None = None) -> OptimizerConfig:
        """The client optimizer of ``server_round``: its learning rate is ``round_lr`` (the one
        source of the decayed rate) unless a protocol's own ``lr`` setting is given."""
        t = self.cfg.train
        return OptimizerConfig(
            lr=float(lr if lr is not None else round_lr(self.cfg, server_round)),
            momentum=float(t.momentum),
            weight_decay=float(t.weight_decay),
            nesterov=bool(t.nesterov),
            decay_biases=bool(t.decay_biases),
        )

    def state_key(self, name: str) -> str:
        """Key of this run variant's entry ``name`` in the client state (variants share nodes)."""
        return f"{self.cfg.label}/{name}"

    def generator(self, server_round: int, salt: int = 0) -> torch.Generator:
        """Shuffling generator: a pure function of (seed, round, client, salt)."""
        return seeded_generator(self.cfg.seed, server_round, self.partition_id, salt)

    @property
    def augment(self) -> str | None:
        """The configured training augmentation (``train.augment``), None when there is none."""
        return None if self.cfg.train.augment == "none" else str(self.cfg.train.augment)

    def local_training(self, config: ConfigRecord, prox_mu: float = 0.0, prox_pull: str = "gradient",
                       params: list[torch.nn.Parameter] | None = None,
                       grad_correction: list[torch.Tensor] | None = None,
                       prox_anchor: list[torch.Tensor] | None = None, lr: float | None = None,
                       salt: int = 0) -> TrainResult:
        """The configured local epochs (or exact steps) at this round's learning rate (or ``lr``),
        updating only ``params`` when given (default: the whole model), with FedProx's pull
        ``prox_mu`` toward the start (or toward ``prox_anchor``) entering as ``prox_pull`` says
        (:func:`task.learning.engine.train`) and ``grad_correction`` added to every gradient
        (SCAFFOLD); ``salt`` gives a second training of the same round its own shuffling."""
        t = self.cfg.train
        server_round = int(config["server-round"])
        if self.model_training is not None:
            if params is not None or prox_mu or t.local_steps is not None or grad_correction is not None:
                raise ValueError(f"model.name={self.cfg.model.name} trains with its own objective: whole local "
                                 "epochs of the whole model, without a proximal term or gradient correction")
            return self.model_training.train(self, config, lr, salt)
        return train(
            self.model,
            self.train,
            self.optimizer(server_round, lr),
            batch_size=int(t.batch_size),
            generator=self.generator(server_round, salt),
            epochs=int(t.local_epochs),
            steps=t.local_steps,
            params=params,
            prox_mu=prox_mu,
            prox_pull=prox_pull,
            prox_anchor=prox_anchor,
            regression=self.regression,
            augment=self.augment,
            grad_correction=grad_correction,
        )

    def head_keys(self) -> list[str]:
        """State keys of this run's head (``model.head``, resolved once per worker)."""
        return self.model.parameter_names(self.head)

    def body_keys(self) -> list[str]:
        """State keys of everything before the head."""
        head = set(self.head_keys())
        return [k for k in self.model.state_dict() if k not in head]

    def reset_model(self) -> None:
        """Put the run's common initial weights into the model."""
        self.model.load_state_dict(self.initial_state)

    def load(self, arrays: ArrayRecord) -> None:
        """Copy the received arrays into the model (a subset of its state is allowed)."""
        state = arrays.to_torch_state_dict()
        own = self.model.state_dict()
        unknown = [k for k in state if k not in own]
        if unknown:
            raise KeyError(f"received arrays the model does not have: {unknown[:5]}")
        with torch.no_grad():
            for key, value in state.items():
                own[key].copy_(value.to(own[key].device))

    def arrays(self, names: list[str] | None = None) -> ArrayRecord:
        """The model's state (only ``names`` when given) as an ArrayRecord on the CPU."""
        state = self.model.state_dict()
        keys = names if names is not None else list(state)
        return ArrayRecord({k: state[k].detach().cpu() for k in keys})

    def evaluate_local(self, config: ConfigRecord | None = None) -> dict[str, float]:
        """Loss and accuracy of the current model on this client's local test split, and its
        accuracy on the validation part when the client holds one (``validation_accuracy``), and
        the metrics of the model's own objective (``model_training``), if it has one."""
        res = evaluate(self.model, self.test, int(self.cfg.eval.batch_size), self.regression)
        out = {"loss": res.loss, NUM_EXAMPLES: float(res.num_examples)}
        if res.accuracy is not None:
            out["accuracy"] = res.accuracy
        if self.validation is not None and len(self.validation) and not self.regression:
            out[VALIDATION_ACCURACY] = evaluate(self.model, self.validation, int(self.cfg.eval.batch_size)).accuracy
        if self.model_training is not None:
            out.update(self.model_training.test_metrics(self, config))
        return out


def configured_head(model: SplitModel, cfg: DictConfig) -> list[str]:
    """The head groups of ``model``: ``model.head`` or the model's default (last layer)."""
    head = list(cfg.model.head) if cfg.model.head is not None else list(model.default_head)
    model.check_groups(head, "model.head")
    model.split_at(head, "model.head")
    return head


def head_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """State keys of the configured head."""
    return model.parameter_names(configured_head(model, cfg))


def body_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """State keys of everything before the configured head (the shared representation)."""
    head = set(head_keys(model, cfg))
    return [k for k in model.state_dict() if k not in head]


def reply(arrays: ArrayRecord | None = None, **metrics: float) -> RecordDict:
    """A reply RecordDict with optional arrays and a MetricRecord of ``metrics``."""
    content = RecordDict({METRICS: MetricRecord({k: float(v) for k, v in metrics.items()})})
    if arrays is not None:
        content[ARRAYS] = arrays
    return content


def round_config(content: RecordDict) -> ConfigRecord:
    """The ConfigRecord of a received message (empty when absent)."""
    return content[CONFIG] if CONFIG in content else ConfigRecord()


def round_lr(cfg: DictConfig, server_round: int) -> float:
    """The client learning rate of ``server_round``: ``train.lr · train.lr_decay^(round − 1)``."""
    return float(cfg.train.lr) * float(cfg.train.lr_decay) ** (server_round - 1)


#: How the reason of a failed client starts when no node answered for its partition (the node is
#: gone, or its reply came too late), as opposed to a client that answered with an error.
UNSERVED_REASONS = ("no reply", "unavailable: ")


def failure_fields(failed: dict[int, str]) -> dict:
    """A record's failure fields: the failed partition ids, why each failed, and those of them
    that no node served (:data:`UNSERVED_REASONS`)."""
    return {"failed_clients": list(failed), "failures": {str(pid): why for pid, why in failed.items()},
            "unserved_clients": [pid for pid, why in failed.items() if why.startswith(UNSERVED_REASONS)]}


def fmt(value: float | None) -> str:
    """A metric for a log line (``n/a`` when absent)."""
    return "n/a" if value is None else f"{value:.4g}"


def best_over_rounds(evals: list[dict], latest_on_ties: bool = True) -> dict:
    """The official LG-FedAvg code's Local Test selection: each client's highest accuracy over
    the evaluation records that hold it, and their mean over clients. On ties the latest round
    (main_lg.py ``best_acc_list``) or the earliest (main_local.py). A selection on test data:
    reported beside the final-window mean, never instead."""
    best: dict[str, float] = {}
    at: dict[str, int] = {}
    for record in evals:
        for client, acc in (record.get("client_accuracy") or {}).items():
            if client not in best or acc > best[client] or (latest_on_ties and acc == best[client]):
                best[client], at[client] = acc, int(record["round"])
    clients = sorted(best, key=int)
    return {
        "local_test_best_over_rounds": float(np.mean([best[c] for c in clients])) if clients else None,
        "local_test_best_client_accuracy": {c: best[c] for c in clients},
        "local_test_best_client_round": {c: at[c] for c in clients},
    }
