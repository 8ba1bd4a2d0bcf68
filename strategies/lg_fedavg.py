"""LG-FedAvg (Liang et al., 2020, Algorithm 1): local parts kept on the clients, a global part averaged.

Which layer groups are global is ``lg.global_part``: ``paper`` (the paper's description:
local body, global head; the last three layer groups, e.g. 99,978 of the MNIST MLP's
633,226 parameters), ``official_cifar`` (the official code's CIFAR variant: the convolution
groups are global, 2,872 of LeNet-5's 64,102) or a list of group names.

As in the paper, training starts with FedAvg on the whole model (``lg.fedavg_rounds``
rounds, or until the global model first reaches ``lg.goal_accuracy`` on the global test
set at an evaluated round). LG starts from the warm start's last model (``lg.warm_start=last``,
the paper) or from its global model of the best evaluated global accuracy (``best``, a selection
on the test set: the official main_fed.py saves ``best_<N>.pt``, the best of its first N rounds,
tested every round, which main_lg.py loads with ``--load_fed``; summary: ``lg_warm_start_round``,
``lg_warm_start_accuracy``). The warm start trains at ``lg.warm_start_lr`` when set, fixed
(main_fed.py never passes its --lr or decayed rate: LocalUpdate.train's default 0.1 trains), else
at ``train.lr``. Then ``lg.lg_rounds`` LG rounds follow (the paper's "LG Rounds" column; unset:
LG until ``rounds``, which is always the cap). A run that never leaves the warm start, or whose
cap cuts its LG rounds short, is a failed run. From the switch on:

Server: FedAvg (weights: ``train.aggregation``) of the global part only. The server keeps the whole
model; a client that has no local part yet receives the warm-start model's local part once
(counted in the traffic), every other message carries the global part only.
Client: loads the global part and its own local part (kept across rounds on the node:
``context.state``, or the node's disk when large, see ``strategies/state_store.py``), trains
both for the local epochs, keeps the local part and sends back the global part.
Evaluation (Local Test): each client with its own local part and the current global part;
the headline is the final-window mean. The summary also reports the official code's selection
(``local_test_best_over_rounds``): each client's best Local Test accuracy over the rounds in
which it was evaluated, from the warm-start model LG starts from on, chosen on its test data.
New Test: after training every client sends its local part once (``query.localpart``); the
server averages the logits (or softmax outputs) of all local models with the global part on
the global test set.

``new_test.models=best`` (New Test on) is the official main_lg.py's selection, made on the test
data. Each client keeps the local part of its best Local Test evaluation in LG (the latest of
ties). After every evaluated LG round the server averages the global parts those best models were
evaluated with (it keeps the global part of every round still someone's best) and sends the
average to every client (``query.lgselect``); each client scores its best local part with it,
keeps that model as the round's candidate and replies with the accuracy. The round whose mean
scores highest (the first of ties) is selected (summary ``local_test_selected``, the official
Local Test, and ``local_test_selected_round``): its candidates are the clients' New Test models,
sent whole. Unlike main_lg.py, the warm-start model itself is not a candidate (no client's best
was in the CIFAR-10 runs of ``lg_table1_cifar10``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig, OmegaConf

from strategies.flower_compat import messages_to
from strategies.checks import nonnegative, positive, require
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.common import ARRAYS, CONFIG, NUM_EXAMPLES, ClientRuntime, best_over_rounds, reply, round_config
from strategies.services import Services, is_training_record
from strategies.lg_selection import (SELECT, SELECTED, SELECTED_ROUND, average_of_best, keep_if_best, keep_selected,
                                     select_lg, selects, update_best)
from strategies.state_store import keep_arrays, kept_arrays, load_kept_model
from task.learning.fairness import train_fair
from task.learning.models import FairMLP
from task.learning.split_model import SplitModel

LOCAL_STATE = "lg-local"
PHASE = "lg-phase"


def global_groups(group_names: list[str], cfg: DictConfig) -> list[str]:
    """The layer groups (of a model with ``group_names``) that form the global part."""
    spec = cfg.lg.global_part
    if spec == "paper":
        return group_names[-3:]
    if spec == "official_cifar":
        convs = [g for g in group_names if g.startswith("conv")]
        if not convs:
            raise ValueError(f"lg.global_part=official_cifar needs convolution groups; {group_names} has none")
        return convs
    return list(spec)


def global_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """State keys of the global part."""
    groups = global_groups(model.group_names, cfg)
    model.check_groups(groups, "lg.global_part")
    return model.parameter_names(groups)


def local_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """State keys of the local part (everything that is not global)."""
    shared = set(global_keys(model, cfg))
    return [k for k in model.state_dict() if k not in shared]


class LGFedAvg(ServerHooks, WeightedAverage):
    """FedAvg warm start, then FedAvg of the global part with local parts kept on the clients."""

    checkpointed = ("switch_round", "best_warm_start", "warm_start_from", "client_best", "global_of_round",
                    "selected_round", "selected_accuracy")
    node_keyed = ("initialised",)

    def __init__(self, cfg: DictConfig, fedavg_rounds: int | None, goal_accuracy: float | None,
                 lg_rounds: int | None) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.average_as(cfg)
        self.cfg = cfg
        self.fedavg_rounds = fedavg_rounds
        self.goal_accuracy = goal_accuracy
        self.lg_rounds = lg_rounds
        self.switch_round: int | None = None  # first LG round
        self.initialised: set[int] = set()  # nodes that hold a local part
        self.global_part: set[str] = set()  # state keys of the global part (known from the model at start)
        self.keep_best = cfg.lg.warm_start == "best"
        self.best_warm_start: dict | None = None  # lg.warm_start=best: round, accuracy, arrays (until the switch)
        self.warm_start_from: list | None = None  # [round, global accuracy] of the model LG started from
        self.selecting = selects(cfg)  # main_lg.py's selection (new_test.models=best) and its state:
        self.client_best: dict[str, list] = {}  # partition id -> [accuracy, round] of its best LG evaluation
        self.global_of_round: dict[int, ArrayRecord] = {}  # the global part of each round still someone's best
        self.selected_round = -1  # the round whose models score best with their averaged global part
        self.selected_accuracy: float | None = None

    def on_start(self, services: Services) -> None:
        """Learn the global part's keys from the model (its layer groups, not branches such as an adversary)."""
        self.global_part = set(global_keys(services.model, self.cfg))

    def lg_phase(self, server_round: int) -> bool:
        """Whether ``server_round`` trains local and global parts (after the FedAvg warm start)."""
        if self.switch_round is None and self.fedavg_rounds is not None and server_round > self.fedavg_rounds:
            self.switch_round = self.fedavg_rounds + 1
        return self.switch_round is not None and server_round >= self.switch_round

    def last_round(self, rounds: int) -> int:
        """``lg.lg_rounds`` LG rounds after the switch (never past the cap ``rounds``)."""
        if self.lg_rounds is None or self.switch_round is None:
            return rounds
        return min(rounds, self.switch_round + self.lg_rounds - 1)

    def run_failure(self, last_round: int) -> str | None:
        """A run that never trained LG-FedAvg, or fewer LG rounds than ``lg.lg_rounds``, is not
        a run of LG-FedAvg (whether the cap or a protocol, e.g. the online device's
        ``online.start_accuracy``, ended its rounds)."""
        rounds = int(self.cfg.rounds)
        if self.switch_round is None or self.switch_round > last_round:
            end = (f"lg.goal_accuracy={self.goal_accuracy:g} was not reached at an evaluated round"
                   if self.goal_accuracy is not None else f"lg.fedavg_rounds={self.fedavg_rounds} fills them")
            return (f"LG-FedAvg never left its FedAvg warm start in the {last_round} rounds run ({end}; the cap "
                    f"is rounds={rounds}): no LG round was trained")
        done = last_round - self.switch_round + 1
        if self.lg_rounds is not None and done < self.lg_rounds:
            return (f"the FedAvg warm start ended at round {self.switch_round - 1}, which left {done} of "
                    f"lg.lg_rounds={self.lg_rounds} LG rounds before the run ended at round {last_round} "
                    f"(the cap is rounds={rounds})")
        return None

    def has_global_model(self, server_round: int) -> bool:
        """The whole server model is a global model only during the FedAvg warm start."""
        return not self.lg_phase(server_round)

    def observe_failures(self, nodes: Iterable[int]) -> None:
        """Nodes whose message failed may not hold a local part: send them the warm-start one again."""
        self.initialised.difference_update(nodes)

    def observe_eval(self, server_round: int, record: dict, services: Services) -> None:
        """In the warm start: keep its best global model so far (``lg.warm_start=best``; the first
        of ties, as main_fed.py), and switch to LG-FedAvg after the first evaluated round at the goal
        accuracy. In LG: main_lg.py's selection (``new_test.models=best``)."""
        if self.lg_phase(server_round):
            if self.selecting:
                record.update(self._select(server_round, record, services))
            return
        acc = record.get("global_accuracy")
        if acc is None:
            return
        if self.keep_best and (self.best_warm_start is None or acc > self.best_warm_start["accuracy"]):
            arrays = ArrayRecord(dict(services.get_arrays().items()))  # the round's entries, replaced later
            self.best_warm_start = {"round": server_round, "accuracy": acc, "arrays": arrays}
        if self.switch_round is None and self.goal_accuracy is not None and acc >= self.goal_accuracy:
            self.switch_round = server_round + 1

    def _select(self, server_round: int, record: dict, services: Services) -> dict:
        """One step of main_lg.py's selection after an evaluated LG round: every client scores its
        best local part with the average of the global parts its peers' best models had; the
        round of the best mean is selected (its models answer New Test)."""
        shared = services.get_arrays()
        self.global_of_round[server_round] = ArrayRecord({k: shared[k] for k in shared if k in self.global_part})
        update_best(self.client_best, record.get("client_accuracy") or {}, server_round)
        rounds = {r for _, r in self.client_best.values()}
        self.global_of_round = {r: a for r, a in self.global_of_round.items() if r in rounds}
        if not self.client_best:
            return {}
        average = average_of_best(self.client_best, self.global_of_round)
        config = ConfigRecord({"variant": self.cfg.label, "server-round": server_round, PHASE: "lg",
                               SELECTED_ROUND: self.selected_round})
        pids = sorted(int(p) for p in self.client_best)
        messages = [Message(RecordDict({ARRAYS: average, CONFIG: config}), dst_node_id=node, message_type=SELECT)
                    for node in services.nodes(pids)]
        replies, failed = services.send(messages, "lg-select")
        scores = services.metric_of(replies, "accuracy")
        accuracy = float(np.mean(list(scores.values()))) if scores else None
        if accuracy is not None and (self.selected_accuracy is None or accuracy > self.selected_accuracy):
            self.selected_round, self.selected_accuracy = server_round, accuracy  # main_lg.py: > (the first of ties)
        return {"lg_selection_accuracy": accuracy, "lg_selection_failed": len(failed)}

    def prepare_round(self, server_round: int, services: Services) -> dict | None:
        """At the first LG round: LG starts from the warm start's last model, or its best evaluated one."""
        best = self.best_warm_start
        if best is not None and self.lg_phase(server_round) and server_round == self.switch_round:
            services.set_arrays(best["arrays"])
            self.warm_start_from, self.best_warm_start = [best["round"], best["accuracy"]], None
        return None

    def _messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
                  message_type: str) -> list[Message]:
        config[PHASE] = "lg" if self.lg_phase(server_round) else "fedavg"
        config["server-round"] = server_round
        if config[PHASE] == "fedavg":
            return messages_to(RecordDict({ARRAYS: arrays, CONFIG: config}), grid.get_node_ids(), message_type)
        shared = ArrayRecord({k: arrays[k] for k in arrays if k in self.global_part})
        messages = []
        for node in grid.get_node_ids():
            payload = arrays if node not in self.initialised else shared
            messages.append(Message(RecordDict({ARRAYS: payload, CONFIG: config}), dst_node_id=node,
                                    message_type=message_type))
            self.initialised.add(node)
        return messages

    def reply_template(self, message: Message) -> dict[str, ArrayRecord]:
        """The whole model in the FedAvg warm start, the global part in the LG phase (the first
        LG message to a node also carries the local part it adopts, which never comes back)."""
        arrays = message.content[ARRAYS]
        if round_config(message.content).get(PHASE) != "lg":
            return {ARRAYS: arrays}
        return {ARRAYS: ArrayRecord({k: arrays[k] for k in arrays if k in self.global_part})}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self._messages(server_round, arrays, config, grid, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._messages(server_round, arrays, config, grid, MessageType.EVALUATE)

    def local_part_messages(self, server_round: int, services: Services) -> list[Message] | None:
        """New Test: ask every training client for its local part (None during the FedAvg warm start)."""
        if not self.lg_phase(server_round):
            return None
        config = ConfigRecord({"variant": self.cfg.label, SELECTED_ROUND: self.selected_round})
        return self._messages(server_round, services.get_arrays(), config, services.node_subset(services.trainable),
                              "query.localpart")

    def summary_extra(self, records: list[dict]) -> dict:
        """The first LG round (None: training never left the FedAvg warm start) and the best
        Local Test over rounds, from the last warm-start round (the model LG starts from) on."""
        out: dict = {"lg_switch_round": self.switch_round}
        if self.warm_start_from is not None:
            out["lg_warm_start_round"], out["lg_warm_start_accuracy"] = self.warm_start_from
        if self.switch_round is not None:
            start = self.switch_round - 1
            out["lg_rounds_trained"] = sum(is_training_record(r) and r["round"] >= self.switch_round for r in records)
            evals = [r for r in records if r["phase"] == "eval" and r["round"] >= start]
            out.update(local_test_best_from_round=start, **best_over_rounds(evals))
        if self.selecting:
            out.update(local_test_selected=self.selected_accuracy, local_test_selected_round=self.selected_round)
        return out


def make_strategy(cfg: DictConfig) -> Strategy:
    """The LG-FedAvg server half."""
    return LGFedAvg(cfg, cfg.lg.fedavg_rounds, cfg.lg.goal_accuracy, cfg.lg.lg_rounds)


def _adopt_local_part(rt: ClientRuntime, content: RecordDict) -> bool:
    """Load the received arrays, then this client's own local part (adopting the warm-start
    one the first time it is sent). False during the FedAvg warm start."""
    rt.load(content[ARRAYS])
    if round_config(content).get(PHASE, "fedavg") != "lg":
        return False
    own = kept_arrays(rt, LOCAL_STATE)
    if own is None:
        missing = [k for k in local_keys(rt.model, rt.cfg) if k not in content[ARRAYS]]
        if missing:
            raise ValueError(f"client {rt.partition_id} has no local part yet and the message lacks {missing[:3]}")
        if isinstance(rt.model, FairMLP):
            _pretrain_fair(rt, round_config(content))
        state = rt.model.state_dict()
        keep_arrays(rt, LOCAL_STATE, {k: state[k] for k in local_keys(rt.model, rt.cfg)})
    else:
        state = rt.model.state_dict()
        with torch.no_grad():
            for key, value in own.items():
                state[key].copy_(value.to(state[key].device))
    return True


def _pretrain_fair(rt: ClientRuntime, config: ConfigRecord) -> None:
    """Table 4 protocol: a new local part is pre-trained (representation with the local copy
    of the global classifier, no penalty) for ``fair.pretrain_epochs``, then its adversary
    alone on the frozen representation for as long."""
    epochs = int(rt.cfg.fair.pretrain_epochs)
    if epochs == 0:
        return
    server_round = int(config["server-round"])
    gen = rt.generator(server_round, salt=0x9E7)
    args = (rt.model, rt.train, rt.optimizer(server_round), int(rt.cfg.train.batch_size), gen, epochs, list(rt.cfg.fair.lambdas))
    train_fair(*args, penalize=False)
    train_fair(*args, penalize=False, model_step=False)


def train_lg(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """FedAvg warm start: the whole model. LG phase: own local part + global part trained
    end to end; keep the local part, send the global part."""
    lg = _adopt_local_part(rt, content)
    result = rt.local_training(round_config(content), lr=None if lg else rt.cfg.lg.warm_start_lr)
    metrics = {"train_loss": result.mean_loss, "local_steps": result.steps, NUM_EXAMPLES: len(rt.train)}
    if not lg:
        return reply(rt.arrays(), **metrics)
    state = rt.model.state_dict()
    keep_arrays(rt, LOCAL_STATE, {k: state[k] for k in local_keys(rt.model, rt.cfg)})
    return reply(rt.arrays(global_keys(rt.model, rt.cfg)), **metrics)


def evaluate_lg(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Local Test: the client's own local part with the current global part (with
    ``new_test.models=best``, an LG evaluation at least as good as every earlier one keeps its local part)."""
    lg = _adopt_local_part(rt, content)
    config = round_config(content)
    metrics = rt.evaluate_local(config)
    if lg and selects(rt.cfg) and "accuracy" in metrics:
        keep_if_best(rt, metrics["accuracy"], int(config["server-round"]), local_keys(rt.model, rt.cfg))
    return reply(None, **metrics)


def send_local_part(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """New Test: send the local part once (the warm-start one if never trained in LG); with
    ``new_test.models=best`` the whole model of the selected round (its global part the average)."""
    if selects(rt.cfg):
        keep_selected(rt, round_config(content))
        if load_kept_model(rt, SELECTED):
            return reply(rt.arrays(), **{NUM_EXAMPLES: len(rt.train)})
    _adopt_local_part(rt, content)
    return reply(rt.arrays(local_keys(rt.model, rt.cfg)), **{NUM_EXAMPLES: len(rt.train)})


@dataclass
class LGConfig:
    """``lg.*``."""

    global_part: Any = MISSING  # paper | official_cifar | a list of layer groups
    fedavg_rounds: Optional[int] = nonnegative()  # FedAvg warm-start rounds ...
    goal_accuracy: Optional[float] = positive()  # ... or until this global accuracy
    lg_rounds: Optional[int] = positive()  # LG rounds after the warm start (null: LG until `rounds`)
    warm_start: Literal["last", "best"] = MISSING  # LG starts from the warm start's last model | its best evaluated one
    warm_start_lr: Optional[float] = positive()  # the warm start's fixed client rate (null: train.lr's schedule)


def check(cfg: DictConfig) -> None:
    """The global part, and exactly one way to end the FedAvg warm start."""
    gp = cfg.lg.global_part
    require(gp in ("paper", "official_cifar") or (OmegaConf.is_list(gp) and len(gp) > 0), "lg.global_part",
            f"got {gp!r}, expected paper, official_cifar or a non-empty list of layer groups")
    require((cfg.lg.fedavg_rounds is None) != (cfg.lg.goal_accuracy is None), "lg.fedavg_rounds",
            "set exactly one of lg.fedavg_rounds and lg.goal_accuracy: LG-FedAvg starts from a FedAvg model trained "
            "for a number of rounds or up to a goal accuracy")


def smoke(cfg: DictConfig) -> dict:
    """A one-round warm start (not one up to a goal accuracy), LG-FedAvg in the other rounds."""
    warm = min(1 if cfg.lg.fedavg_rounds is None else int(cfg.lg.fedavg_rounds), int(cfg.rounds) - 1)
    return {"lg.fedavg_rounds": warm, "lg.goal_accuracy": None, "lg.lg_rounds": cfg.lg.lg_rounds and int(cfg.rounds) - warm}


def check_model(cfg: DictConfig, data, model: SplitModel) -> None:
    """The global part names groups of the model and leaves at least one local."""
    require(bool(local_keys(model, cfg)), "lg.global_part", "leaves no local layers; keep at least one group local")
    global_keys(model, cfg)


ALGORITHM = register(Algorithm(
    name="lg_fedavg",
    description="a local representation per client, the top layers global and averaged (Liang et al. 2020)",
    make_strategy=make_strategy,
    handlers={"train": train_lg, "evaluate": evaluate_lg, SELECT: select_lg, "query.localpart": send_local_part},
    shared_keys=all_keys,
    trained_global_keys=global_keys,
    config=LGConfig,
    section="lg",
    check=check,
    check_model=check_model,
    local_representation=True,
    trains_fair_model=True,
    snapshot_after=frozenset({"train", "evaluate", SELECT}),
    new_test_best=True,
    smoke=smoke,
))
