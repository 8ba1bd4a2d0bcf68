"""FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021, Algorithm 1): FedAvg of every layer except the
batch-normalisation layers, which each client keeps.

Server: FedAvg (weights: ``train.aggregation``) of every state key outside the model's
batch-norm layers; it never holds a BN weight, bias or running statistic.
Client: load the received arrays over its own BN layers (kept in the client state; the run's
common initial ones before its first round), train the whole model for the usual local
epochs/steps, keep its BN layers (weights, biases, running statistics), send the rest. Evaluation
scores the received model with the client's own BN layers on its local test split. In the paper
every client trains every round; here the round's sampled clients do (``train.fraction=1.0``:
every client), and a never-sampled client is scored with the initial BN layers.
Needs a model with batch normalisation (``fedrep_cnn_bn``, ``digits_mlp_bn``).
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from omegaconf import DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, register
from strategies.checks import require
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.state_store import keep_arrays, kept_arrays
from task.learning.split_model import SplitModel

BN_STATE = "batch-norm"


class NotBatchNormAverage(ServerHooks, WeightedAverage):
    """FedAvg of the arrays outside the batch-norm layers: no whole model on the server."""

    def has_global_model(self, server_round: int) -> bool:
        """Without BN layers the server's arrays are no model."""
        return False


def make_strategy(cfg: DictConfig) -> NotBatchNormAverage:
    """FedBN's server half: FedAvg of what it receives."""
    return NotBatchNormAverage(**TAKE_ALL_NODES).average_as(cfg)


def batch_norm_keys(model: torch.nn.Module) -> list[str]:
    """State keys of the model's batch-norm layers (weights, biases, running statistics)."""
    prefixes = tuple(f"{name}." for name, m in model.named_modules()
                     if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    return [k for k in model.state_dict() if k.startswith(prefixes)] if prefixes else []


def shared_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """Every state key outside the batch-norm layers."""
    local = set(batch_norm_keys(model))
    return [k for k in model.state_dict() if k not in local]


def load_own_batch_norm(rt: ClientRuntime) -> None:
    """Put the client's kept BN layers into the model; the run's initial ones if it has none."""
    kept = kept_arrays(rt, BN_STATE)
    own = rt.model.state_dict()
    with torch.no_grad():
        for key in batch_norm_keys(rt.model):
            own[key].copy_((kept[key] if kept is not None else rt.initial_state[key]).to(own[key].device))


def train_fedbn(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Local training of the whole model; keep the BN layers, send the rest."""
    rt.load(content[ARRAYS])
    load_own_batch_norm(rt)
    result = rt.local_training(round_config(content))
    state = rt.model.state_dict()
    keep_arrays(rt, BN_STATE, {k: state[k] for k in batch_norm_keys(rt.model)})
    return reply(rt.arrays(shared_keys(rt.model, rt.cfg)), train_loss=result.mean_loss, local_steps=result.steps,
                 **{NUM_EXAMPLES: len(rt.train)})


def evaluate_fedbn(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """The received model with the client's own BN layers on its local test split."""
    rt.load(content[ARRAYS])
    load_own_batch_norm(rt)
    return reply(None, **rt.evaluate_local())


def check_model(cfg: DictConfig, data, model: torch.nn.Module) -> None:
    """FedBN needs batch-norm layers to keep."""
    require(bool(batch_norm_keys(model)), "model.name", f"fedbn keeps the batch-norm layers local and "
            f"{cfg.model.name!r} has none: use a model with batch normalisation (fedrep_cnn_bn, digits_mlp_bn)")


ALGORITHM = register(Algorithm(
    name="fedbn",
    description="FedAvg of every layer but batch normalisation, kept by each client (Li et al. 2021)",
    make_strategy=make_strategy,
    handlers={"train": train_fedbn, "evaluate": evaluate_fedbn},
    shared_keys=shared_keys,
    check_model=check_model,
    supports_finetune=True,
    load_personal=load_own_batch_norm,
))
