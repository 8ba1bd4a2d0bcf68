"""Fed-MTL: mean-regularised multi-task learning, the MTL baseline of LG-FedAvg (Liang et al.,
2020, appendix C.2.4) and FedRep's Table 1 (official code: ``main_mtl.py``, ``LocalUpdateMTL``).

Objective: Σ_i f_i(w_i) + λ₁ tr(WΩWᵀ) + λ₂‖W‖²_F, each client with a whole local model, where
W = [w_1 … w_M] stacks the flattened weights and biases of the first ``mtl.first_groups`` layer
groups (the regularised layers) of the M clients. With the paper's Ω = (I − 11ᵀ/M)² = I − 11ᵀ/M
(idempotent), tr(WΩWᵀ) = Σ_k ‖w_k − w̄‖², and its gradient in client i's column is
2(WΩ)_{:,i} = 2(w_i − w̄) = 2(1 − 1/M)(w_i − mean_{j≠i} w_j): the w̄ inside the other clients'
terms pulls too (client i's own term ‖w_i − w̄‖² alone would give 2(1 − 1/M)(w_i − w̄)). For any
Ω with diagonal δ and off-diagonal o it is 2(δ·w_i + o·S_i), S_i = Σ_{j≠i} w_j.

Server: sends each sampled client S_i, the sum of the other columns of W at the round's start,
and M (``mtl-columns``); keeps every client's latest regularised layers (a client never trained
holds the run's initial ones, which are the server's arrays and never change).
Client: trains its own model (the run's initial weights the first time) with
2λ₁(δ·w_i + o·S_i) + 2λ₂·w_i added to the gradient of its regularised layers at every step (the
other columns fixed, as the official code), keeps the whole model and sends back the regularised
layers only. Evaluation (no arrays sent): each client's own model on its local test split. New
Test (``new_test.enabled``, LG-FedAvg Table 1): every client uploads its whole model once after training
(with ``new_test.models=best`` the model of its best Local Test evaluation, as the official main_mtl.py).

Paper vs official code (pliang279/LG-FedAvg ``main_mtl.py``, ``models/Update.py``; FedRep's copy):
- ``mtl.omega``: ``paper`` Ω = (I − 11ᵀ/M)² (δ = 1 − 1/M, o = −1/M) | ``official``: the code's
  ``I = torch.ones((m, m))`` and elementwise ``** 2`` give Ω = (1 − 1/M)²·11ᵀ (δ = o = (1 − 1/M)²),
  which pulls Σ_k w_k toward zero instead of each w_k toward w̄.
- ``mtl.columns``: ``all`` (the paper: M = every training client, never-trained ones at their
  initial weights) | ``sampled`` (the code: M = the round's sampled clients).
- ``mtl.lam1``/``mtl.lam2``: the paper gives no values; null is the code's λ₁ = λ₂ = 10^-(k + 1),
  k the number of digits of d, the regularised parameters per client.
- ``mtl.first_groups``: the paper's "first few layers"; null: every layer group (the official
  README's ``--num_layers_keep 5`` on its five-group models; FedRep's copy regularises all layers).
- Not reproduced: the code's trace, summed in 4,000-row chunks, skips the last d mod 4,000
  coordinates (all of them when d < 4,000); here every coordinate counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from omegaconf import MISSING, DictConfig

from strategies.flower_compat import checked_replies
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, register
from strategies.checks import nonnegative, positive, require
from strategies.common import ARRAYS, CONFIG, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.local_only import (STATE_KEY, best_evaluated_rounds, evaluate_own_model, own_model_requests,
                                   send_own_model)
from strategies.services import Services
from strategies.state_store import keep_arrays, load_kept_model
from task.learning.split_model import SplitModel

COLUMNS = "mtl-columns"  # round config: M, the columns of W


def regularised_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """Parameter names of the first ``mtl.first_groups`` layer groups (all groups when null)."""
    n = cfg.mtl.first_groups
    groups = set(model.group_names if n is None else model.group_names[: int(n)])
    return [name for name, _ in model.named_parameters() if name.split(".", 1)[0] in groups]


def omega_entries(kind: str, m: int) -> tuple[float, float]:
    """The diagonal and off-diagonal entries of Ω for ``m`` columns (``mtl.omega``)."""
    if kind == "paper":
        return 1.0 - 1.0 / m, -1.0 / m
    c = (1.0 - 1.0 / m) ** 2
    return c, c


def lambdas(cfg: DictConfig, d: int) -> tuple[float, float]:
    """λ₁, λ₂ for ``d`` regularised parameters (null: the official 10^-(digits of d + 1))."""
    official = 10.0 ** -(len(str(int(d))) + 1)
    lam1, lam2 = cfg.mtl.lam1, cfg.mtl.lam2
    return (official if lam1 is None else float(lam1)), (official if lam2 is None else float(lam2))


class FedMTLServer(ServerHooks, FedAvg):
    """Sends each sampled client the sum of the other columns of W; keeps every client's column."""

    node_keyed = ("columns",)

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.all_columns = cfg.mtl.columns == "all"
        self.columns: dict[int, ArrayRecord] = {}  # node id -> its latest regularised layers
        self.services: Services | None = None

    def on_start(self, services: Services) -> None:
        self.services = services

    def has_global_model(self, server_round: int) -> bool:
        """Only local models exist."""
        return False

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        sampled = list(grid.get_node_ids())
        members = sampled
        if self.all_columns and self.services is not None:
            everyone = self.services.nodes(self.services.trainable)
            members = everyone + [n for n in sampled if n not in everyone]
        column = {n: self.columns.get(n, arrays) for n in members}
        total = {k: sum(column[n][k].numpy().astype(np.float64) for n in members) for k in arrays}
        config["server-round"], config[COLUMNS] = server_round, len(members)
        messages = []
        for node in sampled:
            others = ArrayRecord({k: Array((total[k] - column[node][k].numpy()).astype(arrays[k].numpy().dtype))
                                  for k in arrays})
            messages.append(Message(RecordDict({ARRAYS: others, CONFIG: config}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return messages

    def _keep_columns(self, replies: Iterable[Message]) -> list[Message]:
        valid, _ = checked_replies(replies, is_train=True, weighted_by_key=self.weighted_by_key)
        for m in valid:
            self.columns[m.metadata.src_node_id] = m.content[ARRAYS]
        return valid

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Keep the replying clients' columns; average their metrics (the server's arrays stay)."""
        valid = self._keep_columns(replies)
        if not valid:
            return None, None
        return None, self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)

    def aggregate_skipped(self, server_round: int, replies: Iterable[Message]) -> None:
        """The replying clients of a skipped round kept their trained models: their columns count."""
        self._keep_columns(replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return super().configure_evaluate(server_round, ArrayRecord(), config, grid)

    def local_part_messages(self, server_round: int, services: Services) -> list[Message]:
        """New Test (LG-FedAvg Table 1's MTL row): every client sends its own model once."""
        return own_model_requests(services)

    def summary_extra(self, records: list[dict]) -> dict:
        return best_evaluated_rounds(records)


def make_strategy(cfg: DictConfig) -> Strategy:
    """The Fed-MTL server half."""
    return FedMTLServer(cfg)


def _pull(param: torch.nn.Parameter, a: float, offset: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook adding a·w + offset (w: the parameter's value at that step)."""
    return lambda grad: grad + a * param.detach() + offset


def train_mtl(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Local epochs of the client's own model on f_i + the regulariser; keep it, send the regularised layers."""
    config = round_config(content)
    keys = regularised_keys(rt.model, rt.cfg)
    others = content[ARRAYS].to_torch_state_dict()
    if set(others) != set(keys):
        raise ValueError(f"expected the sum of the other clients' {keys}, got {sorted(others)}")
    load_kept_model(rt, STATE_KEY)
    params = dict(rt.model.named_parameters())
    lam1, lam2 = lambdas(rt.cfg, sum(params[k].numel() for k in keys))
    diag, off = omega_entries(str(rt.cfg.mtl.omega), int(config[COLUMNS]))
    a, b = 2 * lam1 * diag + 2 * lam2, 2 * lam1 * off
    handles = [params[k].register_hook(_pull(params[k], a, b * others[k].to(params[k].device, params[k].dtype)))
               for k in keys]
    try:
        result = rt.local_training(config)
    finally:
        for handle in handles:
            handle.remove()
    keep_arrays(rt, STATE_KEY, rt.model.state_dict())
    return reply(rt.arrays(keys), train_loss=result.mean_loss, local_steps=result.steps,
                 **{NUM_EXAMPLES: len(rt.train)})


def no_global_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """None of the server's arrays is a trained global weight (they stay the initial columns)."""
    return []


def check_model(cfg: DictConfig, data: object, model: SplitModel) -> None:
    """``mtl.first_groups`` counts groups the model has."""
    n, groups = cfg.mtl.first_groups, model.group_names
    require(n is None or n <= len(groups), "mtl.first_groups",
            f"got {n}, but {cfg.model.name} has {len(groups)} layer groups {groups}: expected at most {len(groups)}")


@dataclass
class FedMTLConfig:
    """``mtl.*``."""

    lam1: Optional[float] = nonnegative()  # λ₁ of tr(WΩWᵀ); null: the official 10^-(digits of d + 1)
    lam2: Optional[float] = nonnegative()  # λ₂ of ‖W‖²_F; null: as lam1
    first_groups: Optional[int] = positive()  # the regularised (and sent) first layer groups; null: all
    omega: Literal["paper", "official"] = MISSING  # Ω = (I − 11ᵀ/M)² | the code's (1 − 1/M)²·11ᵀ
    columns: Literal["all", "sampled"] = MISSING  # W's columns: every training client | the round's sampled


ALGORITHM = register(Algorithm(
    name="fed_mtl",
    description="mean-regularised multi-task learning, one model per client (Smith et al. 2017)",
    make_strategy=make_strategy,
    handlers={"train": train_mtl, "evaluate": evaluate_own_model, "query.localpart": send_own_model},
    shared_keys=regularised_keys,
    trained_global_keys=no_global_keys,
    config=FedMTLConfig,
    section="mtl",
    check_model=check_model,
    new_test_best=True,
))
