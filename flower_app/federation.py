"""Talking to the federation: handshake, node subsets, communication accounting."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from strategies.common import CONFIG, METRICS
from task.errors import ConfigError

NODE_WAIT_S = 10.0  # simulation registers all nodes before the ServerApp starts


def payload_size(content: RecordDict) -> tuple[int, int]:
    """(number of parameters, serialized bytes) of all arrays in a message's content."""
    params = nbytes = 0
    for record in content.array_records.values():
        for array in record.values():
            params += math.prod(array.shape)
            nbytes += len(array.data)
    return params, nbytes


@dataclass
class Traffic:
    """Parameters and bytes that actually crossed the wire, per direction."""

    params_down: int = 0
    params_up: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)  # parameters both ways, per phase

    def sent(self, messages: Iterable[Message], phase: str = "other") -> None:
        for msg in messages:
            p, b = payload_size(msg.content)
            self.params_down += p
            self.bytes_down += b
            self.by_phase[phase] = self.by_phase.get(phase, 0) + p

    def received(self, replies: Iterable[Message], phase: str = "other") -> None:
        for msg in replies:
            if not msg.has_error():
                p, b = payload_size(msg.content)
                self.params_up += p
                self.bytes_up += b
                self.by_phase[phase] = self.by_phase.get(phase, 0) + p

    def as_dict(self) -> dict[str, int]:
        """The four running totals (per-phase counts: ``by_phase``)."""
        return {k: v for k, v in vars(self).items() if k != "by_phase"}


class NodeSubset:
    """A Grid view that exposes only the given nodes to a Flower strategy's sampling."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid = grid
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


@dataclass
class Federation:
    """The connected nodes and which client (partition id) each one serves."""

    node_of: dict[int, int]  # partition id -> node id
    train_size: dict[int, int] = field(default_factory=dict)  # partition id -> training examples
    pid_of: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.pid_of = {node: pid for pid, node in self.node_of.items()}

    def nodes(self, pids: Iterable[int]) -> list[int]:
        return [self.node_of[p] for p in pids]


def connect(grid: Grid, num_clients: int, traffic: Traffic, wait_s: float = NODE_WAIT_S) -> Federation:
    """Wait for ``num_clients`` nodes, ask each which partition it serves, check the mapping."""
    deadline = time.monotonic() + wait_s
    while len(nodes := list(grid.get_node_ids())) < num_clients and time.monotonic() < deadline:
        time.sleep(0.5)
    if len(nodes) != num_clients:
        raise ConfigError(
            f"data.num_clients: the run has {num_clients} clients but the federation has {len(nodes)} "
            f"SuperNodes; start it with num-supernodes={num_clients} "
            f"(flwr run . --federation-config \"num-supernodes={num_clients}\") or set data.num_clients={len(nodes)}"
        )
    messages = [
        Message(RecordDict({CONFIG: ConfigRecord()}), dst_node_id=node, message_type="query.info") for node in nodes
    ]
    traffic.sent(messages, "handshake")
    replies = list(grid.send_and_receive(messages))
    traffic.received(replies, "handshake")
    node_of: dict[int, int] = {}
    train_size: dict[int, int] = {}
    for rep in replies:
        if rep.has_error():
            raise RuntimeError(f"node {rep.metadata.src_node_id} failed the start-up handshake: {rep.error.reason}")
        pid = int(rep.content[METRICS]["partition-id"])
        if pid in node_of:
            raise ConfigError(f"partition-id {pid} is served by two nodes ({node_of[pid]}, {rep.metadata.src_node_id})")
        node_of[pid] = rep.metadata.src_node_id
        train_size[pid] = int(rep.content[METRICS]["num-train"])
    missing = sorted(set(range(num_clients)) - set(node_of))
    if missing:
        raise ConfigError(f"data.num_clients: no node serves partition ids {missing[:10]}")
    return Federation(node_of, train_size)


def exchange(grid: Grid, messages: list[Message], traffic: Traffic, fed: Federation, phase: str) -> tuple[list[Message], list[int]]:
    """Send, receive, count traffic; return the good replies and the partition ids that failed."""
    traffic.sent(messages, phase)
    replies = list(grid.send_and_receive(messages))
    traffic.received(replies, phase)
    failed = []
    for rep in replies:
        if rep.has_error():
            pid = fed.pid_of.get(rep.metadata.src_node_id, -1)
            failed.append(pid)
            log(WARNING, "%s: client %d (node %d) failed: %s", phase, pid, rep.metadata.src_node_id, rep.error.reason)
    answered = {fed.pid_of.get(r.metadata.src_node_id) for r in replies}
    for msg in messages:
        pid = fed.pid_of.get(msg.metadata.dst_node_id, -1)
        if pid not in answered:
            failed.append(pid)
            log(WARNING, "%s: client %d (node %d) sent no reply", phase, pid, msg.metadata.dst_node_id)
    # replies arrive in any order; aggregating them by partition id makes the floating-point
    # sums, and so the whole run, repeat exactly for a seed
    good = sorted((r for r in replies if not r.has_error()), key=lambda r: fed.pid_of.get(r.metadata.src_node_id, -1))
    return good, sorted(failed)


def metric_of(replies: Iterable[Message], fed: Federation, key: str) -> dict[int, float]:
    """``key`` of each reply's MetricRecord, by partition id."""
    out = {}
    for rep in replies:
        metrics = rep.content[METRICS] if METRICS in rep.content else {}
        if key in metrics:
            out[fed.pid_of[rep.metadata.src_node_id]] = float(np.asarray(metrics[key]))
    return out
