"""APFL (Deng, Kamani, Mahdavi, 2020, Algorithm 1): each client mixes a personal model v,
kept on the client, with the global model w: v̄ = αv + (1 − α)w.

Server: FedAvg of w (weights: ``train.aggregation``).
Client: from the received w^t, w and its own v train side by side on the same batches for the
usual local epochs. ``apfl.variant``: ``paper`` (Algorithm 1: each with its own SGD state, w on
f_i(w), v on f_i(v̄) with v̄ formed from the w of before each step,
:func:`task.learning.mixture.train_mixture`) or ``official`` (the official FedRep code's
``LocalUpdateAPFL``: v stepped through αv + αw on α·f_i, with w's optimizer and momentum,
:func:`task.learning.mixture.train_mixture_official`). A client's first v is ``apfl.start``:
``initial`` (the run's common initial weights) or ``received`` (the w^t it first receives: the
official ``main_apfl.py``, whose ``w_locals`` alias the global model until a client's first
update). The reply is the new w; v stays.
α is ``apfl.alpha``, fixed (the official FedRep code, ``--alpha_apfl 0.75``, and the FedRep
paper) or, with ``apfl.adaptive``, the APFL paper's adaptive α: each client starts from
``apfl.alpha`` and steps it along ∂f_i(v̄)/∂α at the client rate, kept in [0, 1] on the client.
Evaluation scores v̄ = αv + (1 − α)w with the current w on the client's local test split.

The official ``αv + αw`` is a slip for αv + (1 − α)w (its evaluation, ``main_apfl.py``, mixes with
1 − α), and ``main_apfl.py`` cannot run as published (``w_glob_keys`` is never defined); the
``official`` switches are there to measure what that code would do.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from flwr.app import RecordDict
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import one_of, require, unit_interval
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.state_store import PERSONAL_STARTS, keep_arrays, kept_arrays
from task.learning.mixture import mixed_state, train_mixture, train_mixture_official

PERSONAL = "personal-model"
MIXING_WEIGHT = "mixing-weight"


class APFLServer(ServerHooks, WeightedAverage):
    """FedAvg of the global model w."""


def make_strategy(cfg: DictConfig) -> Strategy:
    """APFL's server half: plain FedAvg."""
    return APFLServer(**TAKE_ALL_NODES).average_as(cfg)


def personal_state(rt: ClientRuntime, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The client's own v; if it has none yet, ``apfl.start``'s: the received w or the initial weights."""
    own = kept_arrays(rt, PERSONAL)
    if own is not None:
        return own
    return {k: v.clone() for k, v in (received if rt.cfg.apfl.start == "received" else rt.initial_state).items()}


def mixing_weight(rt: ClientRuntime) -> float:
    """The client's α: ``apfl.alpha``, or its adapted value when ``apfl.adaptive``."""
    kept = kept_arrays(rt, MIXING_WEIGHT) if rt.cfg.apfl.adaptive else None
    return float(kept["alpha"]) if kept is not None else float(rt.cfg.apfl.alpha)


def train_apfl(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """w and the kept v side by side on the same batches; send w, keep v and α (α goes up only with
    ``apfl.report_alpha``)."""
    config = round_config(content)
    server_round = int(config["server-round"])
    rt.load(content[ARRAYS])
    personal = copy.deepcopy(rt.model)
    personal.load_state_dict(personal_state(rt, rt.model.state_dict()))
    t, alpha = rt.cfg.train, mixing_weight(rt)
    batches = (rt.train, rt.optimizer(server_round), int(t.batch_size), rt.generator(server_round),
               int(t.local_epochs), t.local_steps)
    if rt.cfg.apfl.variant == "official":
        result = train_mixture_official(rt.model, personal, alpha, *batches, regression=rt.regression,
                                        augment=rt.augment)
    else:
        result, alpha = train_mixture(rt.model, personal, alpha, *batches, adaptive=bool(rt.cfg.apfl.adaptive),
                                      regression=rt.regression, augment=rt.augment)
    keep_arrays(rt, PERSONAL, personal.state_dict())
    if rt.cfg.apfl.adaptive:
        keep_arrays(rt, MIXING_WEIGHT, {"alpha": torch.tensor([alpha])})
    reported = {"alpha": alpha} if rt.cfg.apfl.report_alpha else {}  # α is private unless the user opts in
    return reply(rt.arrays(), train_loss=result.mean_loss, local_steps=result.steps, **reported,
                 **{NUM_EXAMPLES: len(rt.train)})


def evaluate_mixture(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score v̄ = αv + (1 − α)w, with the received w, on the local test split."""
    rt.load(content[ARRAYS])
    received = rt.model.state_dict()
    rt.model.load_state_dict(mixed_state(personal_state(rt, received), received, mixing_weight(rt)))
    return reply(None, **rt.evaluate_local())


@dataclass
class APFLConfig:
    """``apfl.*``."""

    alpha: float = unit_interval()  # α, the personal model's share of the mixture (the start when adaptive)
    adaptive: bool = MISSING  # the APFL paper's adaptive α (per client) instead of a fixed one
    variant: Literal["paper", "official"] = MISSING  # Algorithm 1's step of v, or the official LocalUpdateAPFL's
    start: one_of(PERSONAL_STARTS) = MISSING  # type: ignore[valid-type]  # a client's first v
    report_alpha: bool = MISSING  # send each client's α up in its train metrics (it stays on the client by default)


def check(cfg: DictConfig) -> None:
    """The adaptive α is the paper's variant's."""
    require(not (cfg.apfl.adaptive and cfg.apfl.variant == "official"), "apfl.adaptive",
            "the official LocalUpdateAPFL has a fixed alpha: adaptive needs apfl.variant=paper")


ALGORITHM = register(Algorithm(
    name="apfl",
    description="each client mixes its personal model with the global one by α (Deng et al. 2020)",
    make_strategy=make_strategy,
    handlers={"train": train_apfl, "evaluate": evaluate_mixture},
    shared_keys=all_keys,
    config=APFLConfig,
    check=check,
))
