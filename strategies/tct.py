"""TCT: train–convexify–train (Yu et al., 2022, Sections 4–5) as one Flower run.

Stage 1 (rounds 1..T1, ``tct.stage1_rounds``): FedAvg with the ``train.*`` settings.
Convexify (before round T1+1): every training client receives the stage-1 model once
(``query.entk``), re-initialises its last layer to one output logit (seeded by the run seed,
the same on every node), computes for each of its samples the gradient of that logit with
respect to all parameters at ``tct.features`` fixed coordinates (``select_coordinates`` of the
run seed: the same on every node and for the test set), stores them on the node's disk
(``tct.feature_dtype``, a memory-mapped ``.npy``; they are never sent) and, with
``tct.normalize``, replies with the per-feature sums and sums of squares and its count. The
server turns these into mean and standard deviation and sends them to each client once, with
its first stage-2 message (the normalisation round's down-link); the server computes the
global test set's features itself with the same network and coordinates.
Stage 2 (rounds T1+1..``rounds``): the linear regression min_W Σ_k π_k (1/n_k)‖Z_k W − Y_k‖² on
standardised features with one-hot targets, W ∈ R^{p×C} starting at 0, solved by
``tct.solver``: ``scaffold`` (TCT: SCAFFOLD with M = ``tct.local_steps`` full-batch GD steps at
η = ``tct.lr``, the server half of ``strategies/scaffold.py``), ``fedavg`` (TCT-FedAvg: the
same local steps, no control variates, FedAvg's average) or ``gd`` (TCT-GD: one full-batch
gradient step per round, FedAvg's average: centralised full-batch GD when it weighs by examples).
FedAvg's averages (stage 1, and stage 2 without SCAFFOLD) weigh the clients as ``train.aggregation`` says.
Prediction is argmax Wᵀz; the server scores W on its test features.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig

from strategies.checks import nonnegative, one_of, positive, require
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.common import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, ClientRuntime, failure_fields, reply, round_config
from strategies.fedavg import FedAvgServer, local_sgd
from strategies.scaffold import CONTROL, Scaffold, control_update, hold_control, settled_control
from strategies.services import Services
from strategies.state_store import keep_arrays, kept_arrays, node_file, state_root
from task.tct.entk import METHODS, entk_network, entk_setup, extract_features, parameter_count
from task.tct.linear import (FEATURE_DTYPES, FeatureMatrix, LocalLeastSquares, feature_moments, one_hot_targets,
                      open_feature_file, standardization)
from task.tct.memory import GIB, check_gram_memory, feature_bytes, memory_plan, require_disk

PHASE = "tct-stage"  # round config: "fedavg" (stage 1) or "linear" (stage 2)
MOMENTS = "moments"  # query.entk reply: per-feature sums and sums of squares
STANDARDIZATION = "standardization"  # server -> client once: per-feature mean and std
FEATURES = "tct-features"
SPECTRUM = "tct-spectrum"
CLIENT_CONTROL = "tct-ci"
WEIGHTS = "W"
SOLVERS = ("scaffold", "fedavg", "gd")  # TCT, TCT-FedAvg, TCT-GD


def stored_bytes(rows: int, cfg: DictConfig) -> int:
    """Bytes of ``rows`` feature rows at ``tct.features`` and ``tct.feature_dtype``."""
    return feature_bytes(rows, int(cfg.tct.features), str(cfg.tct.feature_dtype))


class TCT(ServerHooks, WeightedAverage):
    """FedAvg for T1 rounds, the convexify phase, then the stage-2 solver on W."""

    checkpointed = ("standardization", "test_path", "warned")  # the path of the test features, not the open matrix
    node_keyed = ("informed",)

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.average_as(cfg)
        self.cfg = cfg
        self.stage1_rounds = int(cfg.tct.stage1_rounds)
        self.stage2: ServerHooks = (Scaffold(float(cfg.scaffold.global_lr), str(cfg.scaffold.weighting))
                                    if cfg.tct.solver == "scaffold" else FedAvgServer(cfg))
        self.standardization: ArrayRecord | None = None
        self.informed: set[int] = set()  # nodes that hold the standardisation
        self.test: FeatureMatrix | None = None
        self.test_labels: torch.Tensor | None = None
        self.test_path: Path | None = None  # the server's test features (on disk)
        self.warned = False  # the step-size warning is logged once

    def linear_stage(self, server_round: int) -> bool:
        """Whether ``server_round`` is a stage-2 round."""
        return server_round > self.stage1_rounds

    def observe_population(self, sizes: dict[int, int]) -> None:
        if isinstance(self.stage2, Scaffold):
            self.stage2.observe_population(sizes)

    def state_dict(self, pid_of) -> dict:
        return {**super().state_dict(pid_of), "stage2": self.stage2.state_dict(pid_of)}

    def load_state_dict(self, state, node_of) -> None:
        super().load_state_dict(state, node_of)
        self.stage2.load_state_dict(state["stage2"], node_of)

    def on_start(self, services: Services) -> None:
        """State the feature memory before round 1; refuse a run whose stage-2 Gram matrix
        (min(n_k, p)² per client) cannot fit in this machine's memory. A resumed stage 2
        reopens the server's test features."""
        if self.test_path is not None and self.test is None:
            self._open_test(services, open_feature_file(Path(self.test_path),
                                                        dtype=FEATURE_DTYPES[str(self.cfg.tct.feature_dtype)]))
        sizes = [services.train_sizes[p] for p in services.trainable]
        p, dtype = int(self.cfg.tct.features), str(self.cfg.tct.feature_dtype)
        log(INFO, "[flrep] %s", memory_plan(p, dtype, sizes, len(services.evaluator.test)))
        check_gram_memory(sizes, p)

    def must_evaluate(self, server_round: int) -> bool:
        """The stage-1 model is always evaluated (``tct_stage1_global_accuracy``)."""
        return server_round == self.stage1_rounds

    def observe_failures(self, nodes: Iterable[int]) -> None:
        """A failed message may not have delivered the standardisation: send it again."""
        self.informed.difference_update(nodes)

    def prepare_round(self, server_round: int, services: Services) -> dict | None:
        """Before round T1+1: the convexify phase (returns its record)."""
        if server_round != self.stage1_rounds + 1:
            return None
        return self.convexify(server_round, services)

    def convexify(self, server_round: int, services: Services) -> dict:
        """eNTK features on every training client, moments -> standardisation, test features on
        the server; the server's arrays become W = 0."""
        cfg, start = self.cfg, time.monotonic()
        pids = services.trainable
        evaluator = services.evaluator
        config = ConfigRecord({"variant": cfg.label, "server-round": server_round})
        messages = [Message(RecordDict({ARRAYS: services.get_arrays(), CONFIG: config}), dst_node_id=n,
                            message_type="query.entk") for n in services.nodes(pids)]
        replies, failed = services.send(messages, "entk")
        if not replies:
            raise RuntimeError(f"no client computed its eNTK features (failed: {failed})")
        if cfg.tct.normalize:
            count = sum(int(r.content[METRICS][NUM_EXAMPLES]) for r in replies)
            moments = [r.content[MOMENTS].to_torch_state_dict() for r in replies]
            sums = sum(m["sum"] for m in moments)
            squares = sum(m["sum_squares"] for m in moments)
            mean, std = standardization(count, sums, squares)
            self.standardization = ArrayRecord({"mean": mean, "std": std})
        evaluator.load(services.get_arrays())
        net, coords = entk_setup(evaluator.model, int(cfg.tct.features), int(cfg.seed))
        path = state_root(cfg) / f"server-{services.run_key}" / "test-features.npy"
        require_disk(path.parent, stored_bytes(len(evaluator.test), cfg), "the server's test features")
        raw = open_feature_file(path, (len(evaluator.test), len(coords)), FEATURE_DTYPES[str(cfg.tct.feature_dtype)])
        extract_features(net, evaluator.test.x, coords, raw, str(cfg.tct.entk_method), int(cfg.tct.entk_batch_size))
        self.test_path = path
        self._open_test(services, raw)
        num_classes = int(services.data.bundle.num_classes)
        services.set_arrays(ArrayRecord({WEIGHTS: torch.zeros(len(coords), num_classes)}))
        seconds = [float(r.content[METRICS]["entk_seconds"]) for r in replies]
        record = {"round": server_round - 1, "phase": "convexify", "features": len(coords),
                  "feature_gib": sum(float(r.content[METRICS]["feature_bytes"]) for r in replies) / GIB,
                  "entk_client_seconds_max": max(seconds), "entk_samples_per_s": sum(
                      float(r.content[METRICS][NUM_EXAMPLES]) for r in replies) / max(sum(seconds), 1e-9),
                  "convexify_seconds": time.monotonic() - start, "clients": pids, **failure_fields(failed)}
        log(INFO, "[flrep] convexified: %d clients' eNTK features (p=%d, %.1f samples/s per client), "
            "normalisation %s, %.1fs", len(replies), len(coords), record["entk_samples_per_s"],
            "on" if cfg.tct.normalize else "off", record["convexify_seconds"])
        return record

    def _open_test(self, services: Services, raw: torch.Tensor) -> None:
        scale = self.standardization.to_torch_state_dict() if self.standardization is not None else {}
        self.test = FeatureMatrix(raw, scale.get("mean"), scale.get("std"), services.evaluator.test.y.device)
        self.test_labels = services.evaluator.test.y

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if not self.linear_stage(server_round):
            config[PHASE] = "fedavg"
            return super().configure_train(server_round, arrays, config, grid)
        config[PHASE] = "linear"
        messages = []
        for msg in self.stage2.configure_train(server_round, arrays, config, grid):
            node = msg.metadata.dst_node_id
            if self.standardization is not None and node not in self.informed:
                content = RecordDict(dict(msg.content.items()))
                content[STANDARDIZATION] = self.standardization
                msg = Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
                self.informed.add(node)
            messages.append(msg)
        return messages

    def reply_template(self, message: Message) -> dict[str, ArrayRecord]:
        """Stage 1: the model; stage 2: W (ΔW for SCAFFOLD, with Δc_i shaped like W)."""
        arrays = message.content[ARRAYS]
        if round_config(message.content).get(PHASE) == "linear" and self.cfg.tct.solver == "scaffold":
            return {ARRAYS: arrays, CONTROL: arrays}
        return {ARRAYS: arrays}

    def aggregate_skipped(self, server_round: int, replies: Iterable[Message]) -> None:
        """Stage 2 of a skipped round: SCAFFOLD's c still takes the replying clients' Δc_i."""
        if self.linear_stage(server_round) and isinstance(self.stage2, Scaffold):
            self.stage2.aggregate_skipped(server_round, replies)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if not self.linear_stage(server_round):
            return super().aggregate_train(server_round, replies)
        replies = list(replies)
        arrays, metrics = self.stage2.aggregate_train(server_round, replies)
        stable = [float(m.content[METRICS]["max_stable_lr"]) for m in replies
                  if not m.has_error() and "max_stable_lr" in m.content[METRICS]]
        if metrics is not None and stable:
            metrics["min_stable_lr"] = min(stable)
            if float(self.cfg.tct.lr) >= min(stable) and not self.warned:
                log(WARNING, "[flrep] tct.lr=%g is at or above 2/lambda_max=%.3g of a client's problem: stage-2 "
                    "gradient descent diverges there; lower tct.lr", float(self.cfg.tct.lr), min(stable))
                self.warned = True
        return arrays, metrics

    def evaluate_on_server(self, server_round: int, arrays: ArrayRecord, global_idx: np.ndarray,
                           client_idx: dict[int, np.ndarray]) -> dict | None:
        """Stage 2: accuracy and loss of argmax Wᵀz on the server's test features (global test
        set and each client's local test split); None in stage 1 (the model is evaluated)."""
        if not self.linear_stage(server_round) or self.test is None:
            return None
        out = self.test.matmul(arrays.to_torch_state_dict()[WEIGHTS])
        labels = self.test_labels.to(out.device)
        targets = one_hot_targets(labels, out.shape[1], bool(self.cfg.tct.centered_targets))

        def score(idx: np.ndarray) -> tuple[float, float]:
            rows = torch.as_tensor(idx, device=out.device, dtype=torch.long)
            acc = float((out[rows].argmax(1) == labels[rows]).float().mean())
            return acc, float(((out[rows] - targets[rows]) ** 2).sum(1).mean())

        accuracy, loss = score(global_idx)
        per_client = {pid: score(idx) for pid, idx in client_idx.items() if len(idx)}
        return {"global_accuracy": accuracy, "global_loss": loss,
                "accuracy": {p: v[0] for p, v in per_client.items()}, "loss": {p: v[1] for p, v in per_client.items()}}

    def summary_extra(self, records: list[dict]) -> dict:
        """The stage-1 model's global accuracy (last evaluation of stage 1) and the convexify record."""
        out: dict = {"tct_stage1_rounds": self.stage1_rounds, "tct_solver": str(self.cfg.tct.solver)}
        stage1 = [r for r in records if r["phase"] == "eval" and r["round"] <= self.stage1_rounds]
        if stage1:
            out["tct_stage1_global_accuracy"] = stage1[-1].get("global_accuracy")
        for r in records:
            if r["phase"] == "convexify":
                out.update({f"tct_{k}": r[k] for k in ("features", "feature_gib", "entk_samples_per_s", "convexify_seconds")})
        return out


def make_strategy(cfg: DictConfig) -> Strategy:
    """The TCT server half."""
    return TCT(cfg)


def compute_entk(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """``query.entk``: this client's eNTK features of the received model, kept on the node's
    disk; the reply carries only their count and (with normalisation) their moments."""
    rt.load(content[ARRAYS])
    cfg = rt.cfg
    net, coords = entk_setup(rt.model, int(cfg.tct.features), int(cfg.seed))
    dtype = FEATURE_DTYPES[str(cfg.tct.feature_dtype)]
    path = node_file(rt, FEATURES, ".npy")
    require_disk(path.parent, stored_bytes(len(rt.train), cfg), f"client {rt.partition_id}'s features")
    node_file(rt, SPECTRUM).unlink(missing_ok=True)  # a spectrum belongs to the features it was computed from
    start = time.monotonic()
    raw = open_feature_file(path, (len(rt.train), len(coords)), dtype)
    extract_features(net, rt.train.x, coords, raw, str(cfg.tct.entk_method), int(cfg.tct.entk_batch_size))
    seconds = time.monotonic() - start
    rt.state[rt.state_key(FEATURES)] = ConfigRecord({"path": str(path), "dtype": str(cfg.tct.feature_dtype)})
    out = reply(None, entk_seconds=seconds, feature_bytes=stored_bytes(len(rt.train), cfg),
                **{NUM_EXAMPLES: len(rt.train)})
    if cfg.tct.normalize:
        _, sums, squares = feature_moments(raw)
        out[MOMENTS] = ArrayRecord({"sum": sums, "sum_squares": squares})
    return out


def local_problem(rt: ClientRuntime, content: RecordDict, num_classes: int) -> LocalLeastSquares:
    """This client's stage-2 least-squares problem on its kept (standardised) features; the
    Gram spectrum is computed once and kept next to the features."""
    key = rt.state_key(FEATURES)
    if key not in rt.state:
        raise RuntimeError(f"client {rt.partition_id} holds no eNTK features (its query.entk failed or never arrived)")
    meta = rt.state[key]
    raw = open_feature_file(Path(str(meta["path"])), dtype=FEATURE_DTYPES[str(meta["dtype"])])
    if STANDARDIZATION in content:
        keep_arrays(rt, STANDARDIZATION, content[STANDARDIZATION].to_torch_state_dict())
    mean = std = None
    if rt.cfg.tct.normalize:
        kept = kept_arrays(rt, STANDARDIZATION)
        if kept is None:
            raise RuntimeError(f"client {rt.partition_id} never received the feature standardisation")
        mean, std = kept["mean"], kept["std"]
    features = FeatureMatrix(raw, mean, std, rt.device)
    spectrum_path = node_file(rt, SPECTRUM)
    if spectrum_path.exists():
        kept_spectrum = torch.load(spectrum_path, weights_only=True)
        spectrum = (kept_spectrum["values"], kept_spectrum["vectors"])
    else:
        spectrum = LocalLeastSquares.spectrum(features)
        spectrum_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"values": spectrum[0].cpu(), "vectors": spectrum[1].cpu()}, spectrum_path)
    targets = one_hot_targets(rt.train.y, num_classes, bool(rt.cfg.tct.centered_targets))
    return LocalLeastSquares(features, targets, spectrum)


def linear_round(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Stage 2: local full-batch GD on the linear regression from the received W (with
    SCAFFOLD's correction for ``tct.solver=scaffold``)."""
    tct = rt.cfg.tct
    w0 = content[ARRAYS].to_torch_state_dict()[WEIGHTS]
    problem = local_problem(rt, content, w0.shape[1])
    steps, lr = (1 if tct.solver == "gd" else int(tct.local_steps)), float(tct.lr)
    loss, accuracy = problem.loss_and_accuracy(w0)
    metrics = {"train_loss": loss, "train_accuracy": accuracy, "local_steps": steps,
               "max_stable_lr": min(problem.max_stable_lr(), 1e30), NUM_EXAMPLES: problem.n}
    if tct.solver != "scaffold":
        return reply(ArrayRecord({WEIGHTS: problem.gradient_descent(w0, steps, lr).cpu()}), **metrics)
    c = content[CONTROL].to_torch_state_dict() if CONTROL in content else {}
    config = round_config(content)
    c_i = settled_control(rt, CLIENT_CONTROL, config)
    zero = torch.zeros_like(w0)
    w = problem.gradient_descent(w0, steps, lr, c.get(WEIGHTS, zero) - c_i.get(WEIGHTS, zero)).cpu()
    new_c_i = control_update(c_i, c, {WEIGHTS: w0}, {WEIGHTS: w}, steps, lr)
    hold_control(rt, CLIENT_CONTROL, c_i, new_c_i, int(config["server-round"]))
    out = reply(ArrayRecord({WEIGHTS: w - w0}), **metrics)
    out[CONTROL] = ArrayRecord({WEIGHTS: new_c_i[WEIGHTS] - c_i.get(WEIGHTS, zero)})
    return out


def tct_train(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Stage 1: FedAvg's local SGD; stage 2: the linear round."""
    if round_config(content).get(PHASE, "fedavg") == "fedavg":
        return local_sgd(rt, content)
    return linear_round(rt, content)


@dataclass
class TCTConfig:
    """``tct.*`` (stage 2 with ``tct.solver=scaffold`` also reads ``scaffold.*``)."""

    stage1_rounds: int = nonnegative()  # T1: FedAvg rounds before convexifying
    features: int = positive()  # p: eNTK coordinates
    feature_dtype: one_of(tuple(FEATURE_DTYPES)) = MISSING  # type: ignore[valid-type]
    entk_method: one_of(METHODS) = MISSING  # type: ignore[valid-type]
    entk_batch_size: int = positive()
    normalize: bool = MISSING
    solver: one_of(SOLVERS) = MISSING  # type: ignore[valid-type]
    local_steps: int = positive()  # M
    lr: float = positive()  # η
    centered_targets: bool = MISSING


def check(cfg: DictConfig) -> None:
    """What a TCT run cannot combine with."""
    t1 = cfg.tct.stage1_rounds
    require(t1 < cfg.rounds, "tct.stage1_rounds",
            f"{t1} FedAvg rounds leave no stage-2 round of rounds={cfg.rounds}; `rounds` counts both stages")
    require(cfg.data.num_new_clients == 0, "data.num_new_clients", "TCT has no new-client protocol; set it to 0")
    require(not cfg.data.online_device.enabled, "data.online_device.enabled", "TCT has no online phase")


def check_model(cfg: DictConfig, data, model: torch.nn.Module) -> None:
    """A classification task, and no more eNTK coordinates than the eNTK network has parameters."""
    require(data.bundle.task != "regression", "algorithm",
            "TCT regresses one-hot class targets: it needs a classification dataset")
    size = parameter_count(entk_network(model, int(cfg.seed)))
    require(int(cfg.tct.features) <= size, "tct.features",
            f"{cfg.tct.features} coordinates of a {size:,}-parameter eNTK network ({cfg.model.name} with one output logit)")


def smoke(cfg: DictConfig) -> dict:
    """One FedAvg round, then stage 2 with at most 1,000 eNTK coordinates and 10 GD steps a round."""
    return {"tct.stage1_rounds": min(int(cfg.tct.stage1_rounds), int(cfg.rounds) - 1),
            "tct.features": min(int(cfg.tct.features), 1000), "tct.local_steps": min(int(cfg.tct.local_steps), 10)}


ALGORITHM = register(Algorithm(
    name="tct",
    description="FedAvg, then SCAFFOLD on a convex eNTK linearisation of the model (Yu et al. 2022)",
    make_strategy=make_strategy,
    handlers={"train": tct_train, "query.entk": compute_entk},
    shared_keys=all_keys,
    config=TCTConfig,
    check=check,
    check_model=check_model,
    snapshot_after=frozenset({"train", "evaluate", "query.entk"}),
    smoke=smoke,
))
