"""The registry entry of an algorithm: its server half and its client half side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import RecordDict
from flwr.serverapp.strategy import Strategy
from omegaconf import DictConfig

from strategies.common import ClientRuntime
from task.learning.models import SplitModel

ClientFn = Callable[[ClientRuntime, RecordDict], RecordDict]

# Flower strategies sample from the nodes the server loop hands them (already sampled
# by a seeded, algorithm-independent rule), so they must take all of them.
TAKE_ALL_NODES = dict(
    fraction_train=1.0,
    fraction_evaluate=1.0,
    min_train_nodes=1,
    min_evaluate_nodes=1,
    min_available_nodes=1,
)


@dataclass(frozen=True)
class Algorithm:
    """One federated algorithm.

    - ``make_strategy``: the server half, a Flower ``Strategy``.
    - ``train``: the client half of a training round (content in, reply content out).
    - ``shared_keys``: the model state keys that form the global model (what the server
      holds and sends); ``None`` for algorithms without a global model (Local-only).
    - ``evaluate``: the client's personalized evaluation; ``None`` means each client's
      personalized model *is* the global model, so the server evaluates it on every
      client's local test split itself (same numbers, no messages).
    - ``supports_finetune``: whether ``finetune.enabled`` (+FT) applies.
    - ``global_model``: whether the shared arrays form a whole model to score on the
      global test set (False for FedRep/FedPer, whose heads never leave the clients).
    - ``final_phase``: an extra step after training, given the running ``Experiment`` and
      the federation; returns a metrics record (the New Test of LG-FedAvg and Local-only).
    - ``send_local``: the client half of the New Test: reply with the client's own part.

    A strategy may also define these optional hooks, which the ServerApp calls:
    ``has_global_model(round) -> bool`` (whether its arrays are a global model at that
    round), ``observe_eval(round, record)`` (after each evaluation),
    ``observe_failures(node_ids)`` (nodes whose messages failed) and
    ``observe_population(sizes)`` (once after the handshake: node id -> training examples
    of every training client), ``on_start(experiment, federation)`` (once before round 1),
    ``prepare_round(round, experiment, federation) -> record | None`` (before each training
    round: a phase between rounds, e.g. TCT's convexify step), ``must_evaluate(round)``
    (evaluate this round whatever ``eval.every`` says), ``evaluate_on_server(round, arrays,
    global_idx, client_idx) -> scores | None`` (score arrays that are not a model) and
    ``summary_extra(records) -> dict`` (algorithm-specific summary keys).
    """

    name: str
    make_strategy: Callable[[DictConfig], Strategy]
    train: ClientFn
    shared_keys: Callable[[SplitModel, DictConfig], list[str]] | None
    evaluate: ClientFn | None = None
    supports_finetune: bool = False
    global_model: bool = True
    final_phase: Callable[..., dict] | None = None
    send_local: ClientFn | None = None


def all_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """Every state key: the whole model is global."""
    return list(model.state_dict())
