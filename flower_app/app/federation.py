"""Talking to the federation: handshake, node subsets, communication accounting."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import DEBUG, INFO, WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid

from flower_app.app.elision import PROCESS, asks_for_bodies, resend, shares_processes, wire_messages
from flower_app.app.reply_check import reply_problem
from flower_app.run.console import Progress, plain
from flower_app.run.stop_signals import stop_requested
from flower_app.app.timing import PhaseTimer
from strategies.common import CONFIG, METRICS
from strategies.services import TRAIN_PHASE, TemplateFn
from task.errors import ConfigError

NODE_WAIT_S = 10.0  # simulation registers all nodes before the ServerApp starts
NODE_MARK = "ray-node/"  # reply-metric key prefix: the Ray node that served the reply (on a cluster)


def payload_size(content: RecordDict) -> tuple[int, int]:
    """(number of parameters, serialized bytes) of all arrays in a message's content."""
    params = nbytes = 0
    for record in content.array_records.values():
        for array in record.values():
            params += math.prod(array.shape)
            nbytes += len(array.data)
    return params, nbytes


def mark_node(content: RecordDict, node: str) -> None:
    """Say in a reply's metrics which Ray node served it (on a cluster; taken out by :class:`Traffic`)."""
    if METRICS in content.metric_records:
        content[METRICS][NODE_MARK + node] = 1


def take_node_mark(content: RecordDict) -> str | None:
    """The Ray node a reply says served it (the mark removed before anything aggregates the metrics)."""
    if METRICS not in content.metric_records:
        return None
    metrics = content[METRICS]
    marks = [k for k in metrics.keys() if k.startswith(NODE_MARK)]
    for key in marks:
        del metrics[key]
    return marks[0][len(NODE_MARK):] if marks else None


@dataclass
class Traffic:
    """Parameters and bytes that the algorithm sent, per direction: every message's arrays, counted
    in full also where the simulation left a shared record out of it (:mod:`flower_app.app.elision`)."""

    params_down: int = 0
    params_up: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)  # parameters both ways, per phase
    served_by: dict[str, int] = field(default_factory=dict)  # on a Ray cluster: replies per Ray node

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
                node = take_node_mark(msg.content)
                if node is not None:
                    self.served_by[node] = self.served_by.get(node, 0) + 1

    def as_dict(self) -> dict:
        """The four running totals, and on a Ray cluster the replies per Ray node (per-phase counts: ``by_phase``)."""
        totals = {k: v for k, v in vars(self).items() if k not in ("by_phase", "served_by")}
        return totals | ({"served_by": dict(self.served_by)} if self.served_by else {})


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
    own_data: bool = False  # the nodes hold their own data (node config data-path): they evaluate themselves
    strangers: set[int] = field(default_factory=set)  # nodes serving no client of this run (or gone): not asked again
    process_of: dict[int, str] = field(default_factory=dict)  # node id -> the client process that answered its handshake
    pid_of: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.pid_of = {node: pid for pid, node in self.node_of.items()}

    def nodes(self, pids: Iterable[int]) -> list[int]:
        return [self.node_of[p] for p in pids]


def connect(grid: Grid, num_clients: int, traffic: Traffic, wait_s: float = NODE_WAIT_S,
            handshake: ConfigRecord | None = None, timeout: float | None = None) -> Federation:
    """Wait up to ``wait_s`` for ``num_clients`` nodes, ask each which partition it serves
    (sending ``handshake``, waiting up to ``timeout`` seconds for the answers), check the
    mapping. Extra nodes (a SuperLink may still list a SuperNode that just died) may fail or
    serve other partitions, as long as every client of the run is served."""
    deadline = time.monotonic() + wait_s
    while len(nodes := list(grid.get_node_ids())) < num_clients and time.monotonic() < deadline:
        time.sleep(0.5)
    if len(nodes) < num_clients:
        raise ConfigError(
            f"data.num_clients: the run has {num_clients} clients but the federation has {len(nodes)} "
            f"SuperNodes after waiting faults.node_wait_s={wait_s:g} s; in simulation start it with "
            f"num-supernodes={num_clients} (flwr run . --federation-config \"num-supernodes={num_clients}\"), "
            f"in a deployment start {num_clients} SuperNodes, or set data.num_clients={len(nodes)}"
        )
    answers, failures = _ask_partitions(grid, nodes, traffic, handshake, timeout)
    fed = Federation({}, {})
    own: dict[int, bool] = {}
    for pid, node, size, has_own, process in answers:
        if not 0 <= pid < num_clients:
            log(WARNING, "node %d serves partition %d, which is not part of this run: ignored", node, pid)
            fed.strangers.add(node)
            continue
        if pid in fed.node_of:
            raise ConfigError(f"partition-id {pid} is served by two nodes ({fed.node_of[pid]}, {node})")
        fed.node_of[pid], fed.train_size[pid], own[node] = node, size, has_own
        fed.process_of[node] = process
    fed.__post_init__()
    missing = sorted(set(range(num_clients)) - set(fed.node_of))
    if missing:
        raise _unserved(missing, failures, len(nodes))
    for node, reason in failures.items():
        log(WARNING, "node %d failed its start-up handshake (every client is served by the others): %s", node, reason)
    fed.strangers.update(failures)  # not asked again each round
    fed.own_data = any(own.values())
    if processes := shares_processes(fed.process_of):
        log(INFO, "[flrep] %d client processes serve the %d nodes: a large record that a round's messages share "
            "crosses to each process once", processes, len(fed.process_of))
    if fed.own_data and not all(own.values()):
        lacking = sorted(fed.pid_of[n] for n, has in own.items() if not has)
        raise ConfigError(f"node config: the SuperNodes of partitions {lacking[:10]} have no data-path while the others "
                          "load their own data; give every SuperNode a data-path (or none)")
    return fed


#: The errors a SuperLink makes for a message that no node took or answered (its node is gone).
SUPERLINK_ERRORS = (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)
#: Seconds a node that another claims to replace has to answer that it still serves its partition.
PING_S = 30.0
#: Exchanges of a round, whose progress the round's own bar shows on a terminal.
ROUND_PHASES = (TRAIN_PHASE, "evaluate")


def _still_served(grid: Grid, node: int, pid: int, traffic: Traffic, handshake: ConfigRecord | None,
                  timeout: float | None) -> bool:
    """Whether ``node``, listed by the SuperLink, still answers that it serves partition ``pid``
    (within ``timeout``, at most :data:`PING_S` seconds: a dead node that the SuperLink still lists
    would make it wait until the node's heartbeats expire)."""
    if node not in set(grid.get_node_ids()):
        return False
    answers, _ = _ask_partitions(grid, [node], traffic, handshake, min(timeout or PING_S, PING_S))
    return any(served == pid for served, *_ in answers)


def _error_line(reason: str) -> str:
    """A client's own error message (its first line) in the reason of an error reply, which Ray
    and Flower wrap in their names, a traceback and colour codes."""
    text = plain(reason)
    said = re.search(r"occurred\. Message: *(\S.*)", text)
    if said:
        return said.group(1).strip().removesuffix("'>")  # Flower's <class ...>:<'...'> wrapper
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else text).removesuffix("'>")


def _unserved(missing: list[int], failures: dict[int, str], nodes: int) -> ConfigError:
    """The error of a federation in which no node serves partitions ``missing``: the most common
    error of the nodes whose handshake failed, a plug-in that the ClientApps cannot import above all."""
    if not failures:
        return ConfigError(f"data.num_clients: no node serves partition ids {missing[:10]}")
    line, count = Counter(_error_line(reason) for reason in failures.values()).most_common(1)[0]
    where = f"{count} of {nodes} nodes' ClientApps"
    if line.startswith("plugins: "):  # imported by this ServerApp, not where the clients run
        return ConfigError(f"{line} (in {where}; the ServerApp imported it)")
    return ConfigError(f"data.num_clients: no node serves partition ids {missing[:10]}: {where} failed their "
                       f"start-up handshake with: {line}")


def rejoin(grid: Grid, fed: Federation, traffic: Traffic, handshake: ConfigRecord | None = None,
           timeout: float | None = None) -> list[int]:
    """Adopt nodes that connected after the start (a restarted SuperNode gets a new node id
    but serves the same partition): handshake them (waiting up to ``timeout`` seconds) and map
    their partitions to them. Returns the partition ids that moved to a new node."""
    new = [n for n in grid.get_node_ids() if n not in fed.pid_of and n not in fed.strangers]
    if not new:
        return []
    moved = []
    answers, failures = _ask_partitions(grid, new, traffic, handshake, timeout)
    for node, reason in failures.items():
        log(WARNING, "node %d failed its handshake: %s", node, reason)
    for pid, node, size, _, process in answers:
        if pid not in fed.node_of:
            log(WARNING, "node %d serves partition %d, which is not part of this run: ignored", node, pid)
            fed.strangers.add(node)
            continue
        if _still_served(grid, fed.node_of[pid], pid, traffic, handshake, timeout):
            log(WARNING, "node %d claims partition %d, which node %d still serves: refused (node %d keeps "
                "serving it; give the new SuperNode the partition-id of the node it replaces)",
                node, pid, fed.node_of[pid], fed.node_of[pid])
            fed.strangers.add(node)
            continue
        log(INFO, "[flrep] client %d rejoined on node %d (was node %d)", pid, node, fed.node_of[pid])
        fed.strangers.add(fed.node_of[pid])  # the old node is gone, though the SuperLink may list it a while
        fed.node_of[pid], fed.train_size[pid] = node, size
        fed.process_of[node] = process
        moved.append(pid)
    fed.__post_init__()
    return moved


def _ask_partitions(grid: Grid, nodes: list[int], traffic: Traffic, handshake: ConfigRecord | None,
                    timeout: float | None = None) -> tuple[list[tuple[int, int, int, bool, str]], dict[int, str]]:
    """(partition id, node id, training examples, own data, client process) of every node that answers
    ``query.info`` within ``timeout`` seconds, and why each other node did not (node id -> reason).
    A reply that names no client process counts as one of its own."""
    messages = [Message(RecordDict({CONFIG: handshake or ConfigRecord()}), dst_node_id=node, message_type="query.info")
                for node in nodes]
    traffic.sent(messages, "handshake")
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    traffic.received(replies, "handshake")
    node_of_message = {msg.metadata.message_id: node for msg, node in zip(messages, nodes)}
    asked = set(nodes)
    answers, failures = [], {}
    for rep in replies:
        node = rep.metadata.src_node_id  # or, for an error made by the SuperLink, the node it was meant for
        node = node if node in asked else node_of_message.get(rep.metadata.reply_to_message_id, node)
        if rep.has_error():
            failures[node] = plain(rep.error.reason)
            continue
        metrics = rep.content[METRICS]
        process = rep.content.config_records.get(PROCESS, {}).get("id", f"node {node}")
        answers.append((int(metrics["partition-id"]), node, int(metrics["num-train"]),
                        bool(metrics.get("own-data", 0.0)), str(process)))
    answered = {node for _, node, *_ in answers} | set(failures)
    silent = "no answer" if timeout is None else f"no answer within {timeout:g} s"
    failures.update({node: silent for node in nodes if node not in answered})
    return answers, failures


def exchange(grid: Grid, messages: list[Message], traffic: Traffic, fed: Federation, phase: str,
             template: TemplateFn | None = None, timeout: float | None = None,
             timer: PhaseTimer | None = None) -> tuple[list[Message], dict[int, str]]:
    """Send, receive, count traffic and screen the replies (see :mod:`flower_app.app.reply_check`;
    ``template`` gives the arrays a training reply must carry; the clients' timings go to ``timer``). Returns the sound replies,
    sorted by partition id, and why each other client failed (partition id -> reason): an
    error reply, no reply within ``timeout`` seconds (of each wave, see :func:`send_eliding`), or a
    rejected reply."""
    traffic.sent(messages, phase)
    processes = shares_processes(fed.process_of)
    if processes:  # the engines hand messages out in partition order (Flower's) or as pushed (flrep's):
        # in this order the ones that carry shared records in full go out first
        messages = sorted(messages, key=lambda msg: fed.pid_of.get(msg.metadata.dst_node_id, -1))
    in_a_round = phase in ROUND_PHASES or phase.endswith(f"-{TRAIN_PHASE}")  # a round has its own bar
    progress = Progress(phase, len(messages), bar=not in_a_round)
    try:
        replies, sent_by_id = send_eliding(grid, messages, processes, timeout, progress)
    finally:
        progress.close()
    if stop_requested():  # this process is ending: the replies may be failures the stop caused, never record them
        threading.Event().wait()
    traffic.received(replies, phase)
    if timer is not None:
        timer.take_client_times(replies, phase)
    failed: dict[int, str] = {}
    good: list[tuple[int, Message]] = []
    unmatched: list[str] = []  # errors of the SuperLink about messages it no longer knows
    for rep in replies:
        # an error made by the SuperLink (e.g. node unavailable) comes from the SuperLink's
        # node id: the message it answers says which client it was for
        sent = sent_by_id.get(rep.metadata.reply_to_message_id)
        if sent is None and rep.has_error():
            unmatched.append(plain(rep.error.reason))
            continue
        node = sent.metadata.dst_node_id if sent is not None else rep.metadata.src_node_id
        pid = fed.pid_of.get(node, -1)
        if rep.has_error():
            said = "unavailable" if rep.error.code in SUPERLINK_ERRORS else "error"  # strategies.common.UNSERVED_REASONS
            failed[pid] = f"{said}: {plain(rep.error.reason)}"
        elif sent is None or rep.metadata.src_node_id != node:
            failed[pid] = "reply to no message of this exchange"
        else:
            problem = reply_problem(rep, template(sent) if template is not None else None, phase == "train")
            if problem:
                failed[pid] = f"rejected: {problem}"
            else:
                good.append((pid, rep))
                continue
        log(WARNING, "%s: client %d (node %d) %s", phase, pid, node, failed[pid])
    answered = {pid for pid, _ in good} | set(failed)
    for msg in messages:
        pid = fed.pid_of.get(msg.metadata.dst_node_id, -1)
        if pid not in answered:
            failed[pid] = "no reply" + "".join(f"; SuperLink: {reason}" for reason in dict.fromkeys(unmatched))
            log(WARNING, "%s: client %d (node %d) %s", phase, pid, msg.metadata.dst_node_id, failed[pid])
    # replies arrive in any order; aggregating them by partition id makes the floating-point
    # sums, and so the whole run, repeat exactly for a seed
    good.sort(key=lambda item: item[0])
    return [rep for _, rep in good], dict(sorted(failed.items()))


PULL_INTERVAL_S = 0.1  # seconds between two pulls of replies (as Flower's own send_and_receive)


def send_and_receive(grid: Grid, messages: list[Message], timeout: float | None, progress: Progress) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` (push, then pull until every reply came or ``timeout``
    passed), moving ``progress`` on as replies arrive."""
    waiting = set(grid.push_messages(messages))
    end = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while waiting and (end is None or time.monotonic() < end):
        pulled = list(grid.pull_messages(waiting))
        replies += pulled
        waiting -= {rep.metadata.reply_to_message_id for rep in pulled}
        progress.advance_to(len(replies))
        if waiting:
            time.sleep(PULL_INTERVAL_S)
    return replies


def send_eliding(grid: Grid, messages: list[Message], processes: int, timeout: float | None = None,
                 progress: Progress | None = None) -> tuple[list[Message], dict[str, Message]]:
    """Send ``messages`` with their shared large records left out where ``processes`` client
    processes serve the nodes (:mod:`flower_app.app.elision`; 0: as they are), then those whose
    process lacked a record again in full (a second wave, with its own ``timeout``). Returns the
    replies and, by the id of each message sent, the message of ``messages`` it stood for."""
    wire = wire_messages(messages, processes)
    progress = progress or Progress("replies", len(messages), bar=False)
    replies = send_and_receive(grid, [sent for sent, _, _ in wire], timeout, progress)
    meant = {sent.metadata.message_id: (msg, bodies) for sent, msg, bodies in wire}
    again = [meant[rep.metadata.reply_to_message_id] for rep in replies
             if asks_for_bodies(rep) and rep.metadata.reply_to_message_id in meant]
    if again:
        log(DEBUG, "%d of %d messages reached a client process without their shared records: sent again in full",
            len(again), len(wire))
        resent = [(resend(msg, bodies), msg, bodies) for msg, bodies in again]
        replies = [rep for rep in replies if not asks_for_bodies(rep)]
        replies += send_and_receive(grid, [sent for sent, _, _ in resent], timeout, progress)
        meant.update({sent.metadata.message_id: (msg, bodies) for sent, msg, bodies in resent})
    return replies, {message_id: msg for message_id, (msg, _) in meant.items()}


def other_metrics(replies: Iterable[Message], known: Iterable[str]) -> dict[str, float]:
    """The mean over the replies of each numeric metric not in ``known`` (nor a Ray node mark):
    what a plug-in's handler reports beyond accuracy and loss, recorded rather than dropped."""
    values: dict[str, list[float]] = {}
    skip = set(known)
    for rep in replies:
        metrics = rep.content[METRICS] if METRICS in rep.content else {}
        for key, value in metrics.items():
            if key not in skip and not key.startswith(NODE_MARK) and isinstance(value, (int, float)):
                values.setdefault(key, []).append(float(value))
    return {key: float(np.mean(v)) for key, v in sorted(values.items())}


def metric_of(replies: Iterable[Message], fed: Federation, key: str) -> dict[int, float]:
    """``key`` of each reply's MetricRecord, by partition id."""
    out = {}
    for rep in replies:
        metrics = rep.content[METRICS] if METRICS in rep.content else {}
        if key in metrics:
            out[fed.pid_of[rep.metadata.src_node_id]] = float(np.asarray(metrics[key]))
    return out
