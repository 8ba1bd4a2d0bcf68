"""SCAFFOLD (Karimireddy et al., 2020, Algorithm 1 with control-variate option II).

Server: holds the global model x and the server control variate c (zero at the start).
Each round it sends x and c to the sampled clients S; from their replies it updates
x ← x + η_g · Σ_{i∈S} w_i Δy_i (w_i: the replies' weights, normalised over S) and
c ← c + Σ_{i∈S} π_i Δc_i, where π_i = 1/N (``scaffold.weighting=uniform``: the SCAFFOLD paper
and TCT's official code) or n_i/n (``examples``: TCT's Eq. 1 weighting p_k), N and n counting
every training client. η_g is ``scaffold.global_lr`` (FedRep's baselines: 1, FEMNIST 0.5).
Client: keeps its control variate c_i across rounds on the node (zero at first), runs its
local steps on the corrected gradient g_i(y) − c_i + c, and returns the model delta
Δy = y − x and Δc_i = c_i⁺ − c_i with c_i⁺ = c_i − c + (x − y)/(K·η_l) (option II; K local
steps at the round's learning rate η_l). With client momentum the corrected gradient goes
through the momentum buffer; the paper's analysis is for plain SGD (momentum 0).

c = Σ_i π_i c_i holds exactly even when a reply is lost: the server tells each client, in every
message, the last round whose Δc_i it absorbed (``scaffold-absorbed``), and a client whose
latest c_i⁺ came from a later round (its reply was rejected, timed out, or the server resumed
from an earlier checkpoint) goes back to the c_i it held before that round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from omegaconf import MISSING, DictConfig

from strategies.flower_compat import checked_replies
from strategies.checks import positive
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, all_keys, register
from strategies.common import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.state_store import keep_arrays, kept_arrays

CONTROL = "control"  # the message entry with c (server -> client) or Δc_i (client -> server)
CLIENT_CONTROL = "scaffold-ci"  # the client's c_i in its kept state
ABSORBED = "scaffold-absorbed"  # round config: the last round whose Δc_i the server absorbed from this node
BEFORE = "-before"  # kept beside c_i: the value before its latest round, and that round
ROUND = "round"
WEIGHTINGS = ("uniform", "examples")

Tensors = dict[str, torch.Tensor]


class Scaffold(ServerHooks, FedAvg):
    """The SCAFFOLD server: the global model moves by the averaged client deltas, the
    server control variate by the clients' control-variate changes."""

    checkpointed = ("control",)
    node_keyed = ("absorbed",)

    def __init__(self, global_lr: float = 1.0, weighting: str = "uniform") -> None:
        super().__init__(**TAKE_ALL_NODES)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"scaffold.weighting: unknown value {weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
        self.global_lr, self.weighting = float(global_lr), weighting
        self.control: Tensors = {}  # c; a missing key is zero
        self.population: dict[int, int] = {}  # node id -> training examples, every training client
        self.absorbed: dict[int, int] = {}  # node id -> the last round whose Δc_i is in c
        self._sent: ArrayRecord | None = None  # x of the round being trained

    def observe_population(self, sizes: dict[int, int]) -> None:
        """Learn the training clients (node id -> number of training examples): N and n."""
        self.population = dict(sizes)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._sent = arrays
        config["server-round"] = server_round
        control = ArrayRecord(dict(self.control))
        messages = []
        for node in grid.get_node_ids():
            node_config = ConfigRecord({**config, ABSORBED: self.absorbed.get(node, 0)})
            content = RecordDict({ARRAYS: arrays, CONTROL: control, CONFIG: node_config})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages

    def reply_template(self, message: Message) -> dict[str, ArrayRecord]:
        """A client returns Δx and Δc_i, both shaped like the model it was sent."""
        return {ARRAYS: message.content[ARRAYS], CONTROL: message.content[ARRAYS]}

    def client_share(self, node: int, num_examples: float) -> float:
        """π_i of one client: 1/N, or n_i/n (a node outside the population counts its reply's examples)."""
        if not self.population:
            raise RuntimeError("SCAFFOLD needs its population (observe_population) before aggregating")
        if self.weighting == "uniform":
            return 1.0 / len(self.population)
        return float(self.population.get(node, num_examples)) / sum(self.population.values())

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = checked_replies(replies, is_train=True)
        valid = [m for m in valid if ARRAYS in m.content and CONTROL in m.content]
        if not valid or self._sent is None:
            return None, None
        x = self._sent.to_torch_state_dict()
        shares = [self.client_share(m.metadata.src_node_id, float(m.content[METRICS][NUM_EXAMPLES])) for m in valid]
        deltas = [m.content[ARRAYS].to_torch_state_dict() for m in valid]
        moved = apply_deltas(x, deltas, shares, self.global_lr)
        self._absorb_controls(server_round, valid, shares)
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return ArrayRecord(moved), metrics

    def aggregate_skipped(self, server_round: int, replies: Iterable[Message]) -> None:
        """A round skipped for too few replies leaves x alone, but the clients that replied keep
        their c_i⁺: c takes their Δc_i, so it stays Σ π_i c_i."""
        valid = [m for m in replies if not m.has_error() and CONTROL in m.content]
        shares = [self.client_share(m.metadata.src_node_id, float(m.content[METRICS][NUM_EXAMPLES])) for m in valid]
        self._absorb_controls(server_round, valid, shares)

    def _absorb_controls(self, server_round: int, replies: list[Message], shares: list[float]) -> None:
        """c ← c + Σ π_i Δc_i over ``replies``, remembering each node's absorbed round."""
        for m, share in zip(replies, shares):
            for key, dc in m.content[CONTROL].to_torch_state_dict().items():
                self.control[key] = self.control.get(key, torch.zeros_like(dc)) + share * dc
            self.absorbed[m.metadata.src_node_id] = server_round


def apply_deltas(x: Tensors, deltas: list[Tensors], shares: list[float], global_lr: float) -> Tensors:
    """x + η_g · Σ_i (π_i / Σπ) Δ_i, key by key."""
    total = sum(shares)
    out = {}
    for key, value in x.items():
        step = sum((s / total) * d[key].to(value.dtype) for s, d in zip(shares, deltas))
        out[key] = value + global_lr * step
    return out


def control_update(c_i: Tensors, c: Tensors, start: Tensors, end: Tensors, steps: int, lr: float) -> Tensors:
    """Option II: c_i⁺ = c_i − c + (x − y)/(K·η_l) for every key of ``start`` (missing c, c_i: zero)."""
    if steps == 0:
        return {k: c_i.get(k, torch.zeros_like(v)) for k, v in start.items()}
    out = {}
    for key, x in start.items():
        zero = torch.zeros_like(x)
        out[key] = c_i.get(key, zero) - c.get(key, zero) + (x - end[key]) / (steps * lr)
    return out


def settled_control(rt: ClientRuntime, name: str, config: ConfigRecord) -> Tensors:
    """The client's c_i as the server's c counts it: its latest c_i⁺ unless that came from a round
    after the last one the server absorbed from it (``scaffold-absorbed``); then the c_i it held
    before that round, which becomes its c_i again."""
    before = kept_arrays(rt, name + BEFORE)
    if before is not None and int(before.pop(ROUND)) > int(config.get(ABSORBED, 0)):
        keep_arrays(rt, name, before)
        return before
    return kept_arrays(rt, name) or {}


def hold_control(rt: ClientRuntime, name: str, c_i: Tensors, new_c_i: Tensors, server_round: int) -> None:
    """Keep c_i⁺ of ``server_round`` as the client's c_i, and the c_i it replaces in case the
    reply carrying Δc_i never reaches the server's c."""
    keep_arrays(rt, name + BEFORE, {**c_i, ROUND: torch.tensor(server_round)})
    keep_arrays(rt, name, new_c_i)


def make_strategy(cfg: DictConfig) -> Strategy:
    """The SCAFFOLD server half."""
    return Scaffold(float(cfg.scaffold.global_lr), str(cfg.scaffold.weighting))


def scaffold_train(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Local steps on g_i − c_i + c from the global model; return Δy and Δc_i, keep c_i⁺."""
    rt.load(content[ARRAYS])
    config = round_config(content)
    params = dict(rt.model.named_parameters())
    before = {k: v.detach().clone() for k, v in rt.model.state_dict().items()}
    start = {k: before[k] for k in params}
    c = {k: v.to(rt.device) for k, v in content[CONTROL].to_torch_state_dict().items()} if CONTROL in content else {}
    c_i = {k: v.to(rt.device) for k, v in settled_control(rt, CLIENT_CONTROL, config).items()}
    correction = [c.get(k, torch.zeros_like(p)) - c_i.get(k, torch.zeros_like(p)) for k, p in params.items()]
    result = rt.local_training(config, grad_correction=correction)
    after = rt.model.state_dict()
    end = {k: p.detach() for k, p in params.items()}
    server_round = int(config["server-round"])
    new_c_i = control_update(c_i, c, start, end, result.steps, rt.optimizer(server_round).lr)
    hold_control(rt, CLIENT_CONTROL, c_i, new_c_i, server_round)
    delta = ArrayRecord({k: (after[k] - before[k]).cpu() for k in after})
    change = ArrayRecord({k: (new_c_i[k] - c_i.get(k, torch.zeros_like(v))).cpu() for k, v in new_c_i.items()})
    out = reply(delta, train_loss=result.mean_loss, local_steps=result.steps, **{NUM_EXAMPLES: len(rt.train)})
    out[CONTROL] = change
    return out


@dataclass
class ScaffoldConfig:
    """``scaffold.*`` (also TCT's stage 2)."""

    global_lr: float = positive()  # η_g
    weighting: Literal["uniform", "examples"] = MISSING  # π_i: 1/N or n_i/n


ALGORITHM = register(Algorithm(
    name="scaffold",
    description="control variates that correct the clients' drift (Karimireddy et al. 2020)",
    make_strategy=make_strategy,
    handlers={"train": scaffold_train},
    shared_keys=all_keys,
    config=ScaffoldConfig,
    supports_finetune=True,
))
