"""FedRep (Collins et al., 2021, Algorithm 1): a shared body, a head kept on each client.

Server: Flower's FedAvg over the body only (weighted as ``train.aggregation`` says); with
``fedrep.orthonormalize`` the averaged body of the linear model is QR-orthonormalised, as in
the paper's linear analysis (Section 4).
Client: load the received body and its own head (kept in ``context.state`` across rounds;
the run's common initial head the first time), train the head with the body frozen
(``fedrep.head_epochs`` epochs, or ``fedrep.head_steps`` steps, or exactly by least squares
with ``fedrep.head_solver=exact``), then the body with the head frozen for the usual local
epochs/steps, keep the head and send back the body only. The head trains on body features
computed once in eval mode (``fedrep.head_features=eval``), or, as the official code does,
on the whole model's train-mode forward pass every batch (``train_mode``: a body's dropout
is active and ``train.augment`` applies).

The client helpers below are shared with FedPer (``strategies/fedper.py``), which keeps a
head the same way but trains head and body jointly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig

from strategies.checks import nonnegative, positive, require
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, register
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, body_keys, configured_head, reply, round_config
from strategies.state_store import keep_arrays, kept_arrays
from task.learning.engine import TrainResult
from task.learning.heads import fit_head_least_squares, train_head_in_train_mode, train_head_on_features

HEAD_STATE = "head"
COLD_START_SALT = 4049  # head fits of never-sampled clients shuffle apart from training rounds


class BodyAverage(ServerHooks, WeightedAverage):
    """FedAvg of the body (``train.aggregation``); optionally QR-orthonormalises a linear body after averaging."""

    def __init__(self, orthonormalize: bool = False) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.orthonormalize = orthonormalize

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None and self.orthonormalize:
            arrays = orthonormalize_body(arrays)
        return arrays, metrics

    def has_global_model(self, server_round: int) -> bool:
        """The body alone is no model: the heads never leave the clients."""
        return False


def orthonormalize_body(arrays: ArrayRecord) -> ArrayRecord:
    """Replace the single body weight W = Bᵀ (k × d) by Qᵀ, where B = QR."""
    state = arrays.to_torch_state_dict()
    if len(state) != 1:
        raise ValueError(f"fedrep.orthonormalize needs a body of one bias-free linear layer, got keys {list(state)}")
    (key, weight), = state.items()
    q, r = torch.linalg.qr(weight.double().T)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique QR: positive diagonal of R
    return ArrayRecord({key: q.T.to(weight.dtype).contiguous()})


def make_strategy(cfg: DictConfig) -> Strategy:
    """Body averaging (with the linear orthonormalisation when configured)."""
    return BodyAverage(orthonormalize=bool(cfg.fedrep.orthonormalize)).average_as(cfg)


# -- client helpers shared with FedPer -------------------------------------------------------
def load_own_head(rt: ClientRuntime) -> bool:
    """Load the client's kept head; the common initial head if it has none. True if kept."""
    keys = rt.head_keys()
    stored = kept_arrays(rt, HEAD_STATE)
    own = rt.model.state_dict()
    with torch.no_grad():
        for key in keys:
            source = stored[key] if stored is not None else rt.initial_state[key]
            own[key].copy_(source.to(own[key].device))
    return stored is not None


def keep_head(rt: ClientRuntime) -> None:
    """Store the current head in the client state."""
    state = rt.model.state_dict()
    keep_arrays(rt, HEAD_STATE, {k: state[k] for k in rt.head_keys()})


def fit_head(rt: ClientRuntime, server_round: int, salt: int = 0) -> TrainResult:
    """Train the head with the body frozen as ``fedrep.*`` configures it, at the round's rate."""
    fr = rt.cfg.fedrep
    head = rt.head
    if fr.head_solver == "exact":
        fit_head_least_squares(rt.model, head, rt.train)
        return TrainResult(0.0, 0, len(rt.train))
    args = (rt.model, head, rt.train, rt.optimizer(server_round), int(rt.cfg.train.batch_size),
            rt.generator(server_round, salt + 1))
    kwargs = dict(epochs=int(fr.head_epochs), steps=fr.head_steps, regression=rt.regression)
    if fr.head_features == "train_mode":
        return train_head_in_train_mode(*args, **kwargs, augment=rt.augment)
    return train_head_on_features(*args, **kwargs)


def body_parameters(rt: ClientRuntime) -> list[torch.nn.Parameter]:
    """The trainable parameters of the body."""
    body = set(rt.body_keys())
    return [p for name, p in rt.model.named_parameters() if name in body]


def evaluate_with_own_head(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Global body + the client's head. A client without a head yet (never sampled) uses the
    run's initial head (``fedrep.unsampled_head=initial``) or first fits one on its data, not
    kept (``fit``). The official code scores the last average of the heads (its ``w_locals``
    alias the global model)."""
    rt.load(content[ARRAYS])
    if not load_own_head(rt) and rt.cfg.fedrep.unsampled_head == "fit":
        fit_head(rt, int(round_config(content)["server-round"]), COLD_START_SALT)
    return reply(None, **rt.evaluate_local())


# -- FedRep's client half ---------------------------------------------------------------------
def train_fedrep(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Head first (body frozen), then body (head frozen); keep the head, send the body."""
    rt.load(content[ARRAYS])
    load_own_head(rt)
    config = round_config(content)
    head_result = fit_head(rt, int(config["server-round"]))
    body_result = rt.local_training(config, params=body_parameters(rt))
    keep_head(rt)
    metrics = {
        "train_loss": body_result.mean_loss,
        "head_loss": head_result.mean_loss,
        "local_steps": body_result.steps,
        "head_steps": head_result.steps,
        NUM_EXAMPLES: len(rt.train),
    }
    return reply(rt.arrays(rt.body_keys()), **metrics)


# -- the ``fedrep.*`` section (FedRep's and FedPer's heads) ------------------------------------
@dataclass
class FedRepConfig:
    """``fedrep.*``: how heads are fitted (FedRep and FedPer), and the linear body's orthonormalisation."""

    head_epochs: int = nonnegative()
    head_steps: Optional[int] = positive()
    head_solver: Literal["sgd", "exact"] = MISSING
    orthonormalize: bool = MISSING
    unsampled_head: Literal["initial", "fit"] = MISSING
    head_features: Literal["eval", "train_mode"] = MISSING


def check(cfg: DictConfig) -> None:
    """Orthonormalising needs the linear body; the train-mode head pass needs SGD head epochs."""
    require(not cfg.fedrep.orthonormalize or cfg.model.name == "linear_rep", "fedrep.orthonormalize",
            f"orthonormalising the body needs model.name=linear_rep, got {cfg.model.name!r}")
    require(cfg.fedrep.head_features == "eval" or cfg.fedrep.head_solver == "sgd", "fedrep.head_features",
            "train_mode trains the head by SGD; fedrep.head_solver=exact fits it in closed form")


def check_model(cfg: DictConfig, data, model: torch.nn.Module) -> None:
    """The exact head solver: least squares of one linear head on a regression task."""
    if cfg.fedrep.head_solver != "exact":
        return
    require(data.bundle.task == "regression", "fedrep.head_solver", f"'exact' (least squares) needs a regression "
            f"dataset, data.name={cfg.data.name!r} is a classification task")
    head = configured_head(model, cfg)
    require(len(head) == 1 and isinstance(model.get_submodule(head[0]), torch.nn.Linear), "fedrep.head_solver",
            f"'exact' needs a head of one linear layer, model.head={head}")


def smoke(cfg: DictConfig) -> dict:
    """One head epoch (or at most 10 head steps) a round."""
    steps = cfg.fedrep.head_steps
    return {"fedrep.head_epochs": min(int(cfg.fedrep.head_epochs), 1),
            "fedrep.head_steps": None if steps is None else min(int(steps), 10)}


ALGORITHM = register(Algorithm(
    name="fedrep",
    description="a shared body averaged, each client's own head trained first and kept (Collins et al. 2021)",
    make_strategy=make_strategy,
    handlers={"train": train_fedrep, "evaluate": evaluate_with_own_head},
    shared_keys=body_keys,
    config=FedRepConfig,
    check=check,
    check_model=check_model,
    supports_finetune=True,
    load_personal=load_own_head,
    smoke=smoke,
))
