"""The ServerApp: validates the run, drives the rounds, evaluates, writes the results."""

from __future__ import annotations

import json
import math
import shutil
import time
import uuid
from datetime import datetime
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from flower_app import checkpoint
from flower_app.comparison import comparison_table, write_comparison
from flower_app.config import clients_per_round, pick_device, validate_with_data, variants_from_run_config
from flower_app.federation import Federation, NodeSubset, Traffic, connect, exchange, failure_fields, metric_of, rejoin
from flower_app.reply_check import TemplateFn, same_arrays_as_sent
from flower_app.results import RunRecorder
from flower_app.tracking import Tracker
from strategies import ALGORITHMS
from strategies.base import Algorithm
from strategies.common import ARRAYS, CONFIG, body_keys
from task.learning.engine import TensorData, evaluate, predict
from task.learning.fairness import ATTRIBUTES
from task.analysis.linear_rep import global_gradient_norm, new_client_errors, principal_angle_distance
from task.data.federated_data import FederatedData
from task.learning.metrics import client_spread, final_window_mean
from task.learning.models import FairMLP, SplitModel
from task.data.sampling import sample_clients

app = ServerApp()

#: Progress-line fields shown when a round reports them (regression and linear-representation runs).
EXTRA_PROGRESS = (("personalized_loss", "personalized loss"), ("representation_distance", "dist(B,B*)"),
                  ("global_grad_norm", "grad norm"))


def output_dir(cfg: DictConfig) -> Path:
    """``resume`` (a resumed run goes on writing where it started), ``out_dir``, or
    ``outputs/<experiment>-<timestamp>`` under the current directory."""
    if cfg.resume:
        return Path(str(cfg.resume)).expanduser().resolve()
    if cfg.out_dir:
        return Path(str(cfg.out_dir)).expanduser().resolve()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return (Path.cwd() / "outputs" / f"{cfg.experiment}-{stamp}").resolve()


class ServerEvaluator:
    """Evaluates the global model centrally: on every client's local test split and on the global test set."""

    def __init__(self, fed: FederatedData, model: SplitModel, cfg: DictConfig) -> None:
        self.fed = fed
        device = pick_device(cfg)
        self.model = model.to(device)
        self.batch = int(cfg.eval.batch_size)
        self.regression = fed.bundle.task == "regression"
        test = fed.bundle.test
        self.test = TensorData.from_arrays(test.x, test.y, device)
        self._pooled: tuple[tuple[int, ...], TensorData] | None = None

    def _split(self, idx: np.ndarray) -> TensorData:
        t = torch.as_tensor(idx, dtype=torch.long, device=self.test.y.device)
        return TensorData(self.test.x[t], self.test.y[t])

    def load(self, arrays: ArrayRecord) -> None:
        self.model.load_state_dict(arrays.to_torch_state_dict(), strict=False)

    def global_metric(self) -> tuple[float | None, float]:
        res = evaluate(self.model, self._split(self.fed.global_test), self.batch, self.regression)
        return res.accuracy, res.loss

    @property
    def linear(self) -> bool:
        """Whether this is the linear representation setting (ground truth B* known)."""
        return "B_star" in self.fed.bundle.meta and "body" in self.model.group_names

    def linear_metrics(self, arrays: ArrayRecord, pids: tuple[int, ...], global_model: bool) -> dict:
        """dist(B, B*) of the shared body; the global-loss gradient norm for a global model."""
        state = arrays.to_torch_state_dict()
        b = state["body.weight"].double().numpy().T
        out = {"representation_distance": principal_angle_distance(b, self.fed.bundle.meta["B_star"])}
        if global_model:
            out["global_grad_norm"] = global_gradient_norm(self.model, self._pooled_train(pids))
        return out

    def _pooled_train(self, pids: tuple[int, ...]) -> TensorData:
        """All ``pids``' training samples on the device (built once per run)."""
        if self._pooled is None or self._pooled[0] != pids:
            train = self.fed.bundle.train
            idx = np.concatenate([self.fed.client_train[p] for p in pids])
            self._pooled = (pids, TensorData.from_arrays(train.x[idx], train.y[idx], self.test.y.device))
        return self._pooled[1]

    def per_client(self, pids: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        acc, loss = {}, {}
        for pid in pids:
            res = evaluate(self.model, self._split(self.fed.client_test[pid]), self.batch, self.regression)
            if res.accuracy is not None:
                acc[pid] = res.accuracy
            loss[pid] = res.loss
        return acc, loss


class Experiment:
    """One run: the round loop of the configured algorithm plus the evaluation protocol."""

    def __init__(self, grid: Grid, cfg: DictConfig) -> None:
        self.grid, self.cfg = grid, cfg
        self.start = time.monotonic()
        self.algorithm: Algorithm = ALGORITHMS[cfg.algorithm]
        self.data, self.model = validate_with_data(cfg)
        held_out = set(self.data.new_clients) | {self.data.online_device}
        self.trainable = [p for p in range(self.data.num_clients) if p not in held_out]
        self.last_main_round = int(cfg.rounds)
        self.main_done = False  # the main training rounds are over (online.start_accuracy may end them early)
        self.num_sampled = clients_per_round(cfg)
        self.traffic = Traffic()
        self.out_dir = output_dir(cfg)
        self.resumed = checkpoint.load(self.out_dir, cfg) if cfg.resume else None
        if self.resumed is None:  # a fresh start: no snapshot of an earlier run in this folder may be restored
            shutil.rmtree(checkpoint.checkpoint_dir(self.out_dir), ignore_errors=True)
        self.run_token = self.resumed["run_token"] if self.resumed else uuid.uuid4().hex[:12]
        self.recorder = RunRecorder(self.out_dir, cfg,
                                    checkpoint.saved_records(self.out_dir, self.resumed) if self.resumed else ())
        self.name = f"{cfg.experiment}-{cfg.label}-s{cfg.seed}"
        self.tracker = Tracker(cfg, self.out_dir, self.name)
        self.evaluator = ServerEvaluator(self.data, self.model, cfg)
        self.strategy = self.algorithm.make_strategy(cfg)
        # fair models are evaluated on the clients, where the protected attributes live
        self.fair = isinstance(self.model, FairMLP)
        if self.algorithm.shared_keys is None:
            self.arrays = ArrayRecord()
        else:
            state = self.model.state_dict()
            self.arrays = ArrayRecord({k: state[k].detach().clone() for k in self.algorithm.shared_keys(self.model, cfg)})
        self.next_round = 1
        if self.resumed is not None:
            self.restore(self.resumed)

    def restore(self, saved: dict) -> None:
        """Continue from a checkpoint: arrays, strategy state, traffic, rounds, elapsed time."""
        self.arrays = ArrayRecord({k: Array(v) for k, v in saved["arrays"].items()})
        self.strategy = checkpoint.unpickle_strategy(saved["strategy"])
        self.traffic = Traffic(**saved["traffic"])
        self.last_main_round, self.next_round = saved["last_main_round"], saved["round"] + 1
        self.main_done = saved["main_done"]
        self.start -= saved["elapsed_s"]
        log(INFO, "[flrep] resuming %s after round %d", self.out_dir, saved["round"])

    def handshake(self, restore_round: int = -1) -> ConfigRecord:
        """What a node hears when it joins: the variant, where clients snapshot their state
        after each round, and the round whose snapshot to restore (-1: none)."""
        return ConfigRecord({"variant": self.cfg.label,
                             "checkpoint-dir": str(checkpoint.checkpoint_dir(self.out_dir) / "clients"),
                             "checkpoint-key": f"{self.name}-{self.run_token}", "restore-round": restore_round,
                             "input-shape": [int(d) for d in self.data.bundle.input_shape],
                             "num-classes": int(self.data.bundle.num_classes)})

    def save_checkpoint(self, t: int, fed: Federation) -> None:
        """The server checkpoint at the end of round ``t``."""
        checkpoint.save(self.out_dir, {
            "round": t, "config": checkpoint.plain_config(self.cfg), "arrays": checkpoint.arrays_state(self.arrays),
            "strategy": checkpoint.strategy_bytes(self.strategy, fed.pid_of), "run_token": self.run_token,
            "records_count": len(self.recorder.records),
            "traffic": dict(vars(self.traffic)), "last_main_round": self.last_main_round, "main_done": self.main_done,
            "elapsed_s": time.monotonic() - self.start})

    # -- phases ---------------------------------------------------------------------------
    def train_round(self, t: int, fed: Federation, pids: list[int] | None = None) -> dict:
        if pids is None:
            pids = sample_clients(self.trainable, self.num_sampled, int(self.cfg.seed), t)
        config = ConfigRecord({"lr": float(self.cfg.train.lr) * float(self.cfg.train.lr_decay) ** (t - 1),
                               "variant": self.cfg.label})
        messages = list(self.strategy.configure_train(t, self.arrays, config, NodeSubset(self.grid, fed.nodes(pids))))
        template = getattr(self.strategy, "reply_template", same_arrays_as_sent)
        replies, failed = self.exchange(messages, fed, "train", template)
        record = {"round": t, "phase": "train", "clients": pids, **failure_fields(failed)}
        minimum = min(int(self.cfg.faults.min_replies), len(messages))  # online rounds ask fewer clients
        if len(replies) < minimum:
            log(WARNING, "[flrep] round %d skipped: %d sound replies, faults.min_replies=%d", t, len(replies), minimum)
            record["skipped"] = True
            skipped = getattr(self.strategy, "aggregate_skipped", None)  # state the clients already committed
            if skipped is not None:
                skipped(t, replies)
            return record
        new_arrays, metrics = self.strategy.aggregate_train(t, replies)
        if new_arrays is not None:
            for key in new_arrays:
                self.arrays[key] = new_arrays[key]
        if metrics is not None:
            record.update({k: float(v) for k, v in metrics.items()})
        return record

    @property
    def reply_timeout(self) -> float | None:
        """``faults.reply_timeout_s``: how long to wait for replies (None: until each arrives or fails)."""
        timeout = self.cfg.faults.reply_timeout_s
        return None if timeout is None else float(timeout)

    def exchange(self, messages: list[Message], fed: Federation, phase: str,
                 template: TemplateFn | None = None) -> tuple[list[Message], dict[int, str]]:
        """Send ``messages``, screen the replies (``faults.reply_timeout_s``), tell the strategy
        which nodes failed; the sound replies and why the others failed (partition id -> reason)."""
        replies, failed = exchange(self.grid, messages, self.traffic, fed, phase, template, self.reply_timeout)
        observe = getattr(self.strategy, "observe_failures", None)
        if observe is not None and failed:
            observe(fed.nodes(p for p in failed if p in fed.node_of))
        return replies, failed

    def evaluate_round(self, t: int, fed: Federation, pids: list[int] | None = None) -> dict:
        pids = self.trainable if pids is None else pids
        record: dict = {"round": t, "phase": "eval"}
        on_server = getattr(self.strategy, "evaluate_on_server", None)
        # nodes with their own data: the server's copy has none of their test splits to score
        client_idx = {} if fed.own_data else {p: self.data.client_test[p] for p in pids}
        scores = on_server(t, self.arrays, self.data.global_test, client_idx) if on_server is not None else None
        if scores is not None:  # the strategy scores its own (non-model) arrays, e.g. TCT's stage 2
            record["global_accuracy"], record["global_loss"] = scores["global_accuracy"], scores["global_loss"]
            accs, losses, failed = scores["accuracy"], scores["loss"], {}
        else:
            accs, losses, failed = self._evaluate_model(t, fed, pids, record)
        spread = client_spread(accs.values()) if accs else {}
        record.update(
            personalized_accuracy=spread.get("mean"),
            personalized_accuracy_std=spread.get("std"),
            personalized_accuracy_worst10=spread.get("worst10"),
            personalized_loss=float(np.mean(list(losses.values()))) if losses else None,
            client_accuracy={str(k): v for k, v in sorted(accs.items())},
            **failure_fields(failed),
        )
        return record

    def _evaluate_model(self, t: int, fed: Federation, pids: list[int], record: dict) -> tuple[dict, dict, dict[int, str]]:
        """Global metrics of the server's model into ``record``; personalized accuracy and loss
        per client (on the server, or by the clients when the algorithm evaluates there)."""
        if self.algorithm.shared_keys is not None and self.algorithm.global_model and self._has_global_model(t):
            self.evaluator.load(self.arrays)
            record["global_accuracy"], record["global_loss"] = self.evaluator.global_metric()
        if self.evaluator.linear and self.algorithm.shared_keys is not None:
            record.update(self.evaluator.linear_metrics(self.arrays, tuple(self.trainable), self.algorithm.global_model))
        if self.algorithm.evaluate is None and not self.fair and not fed.own_data:
            accs, losses = self.evaluator.per_client(pids)
            return accs, losses, {}
        config = ConfigRecord({"variant": self.cfg.label, "server-round": t, "postfit": self.fair and t == int(self.cfg.rounds)})
        messages = list(self.strategy.configure_evaluate(t, self.arrays, config, NodeSubset(self.grid, fed.nodes(pids))))
        replies, failed = self.exchange(messages, fed, "evaluate")
        if self.fair:
            record.update(fairness_means(replies, fed))
        return metric_of(replies, fed, "accuracy"), metric_of(replies, fed, "loss"), failed

    def _has_global_model(self, t: int) -> bool:
        """Whether the server's arrays form a global model at round ``t`` (strategy hook)."""
        check = getattr(self.strategy, "has_global_model", None)
        return check(t) if check is not None else True

    def finetune_phase(self, fed: Federation) -> dict:
        config = ConfigRecord({"epochs": int(self.cfg.finetune.epochs), "variant": self.cfg.label})
        content = RecordDict({ARRAYS: self.arrays, CONFIG: config})
        messages = [Message(content, dst_node_id=n, message_type="train.finetune") for n in fed.nodes(self.trainable)]
        replies, failed = self.exchange(messages, fed, "finetune")
        before, after = metric_of(replies, fed, "accuracy_before"), metric_of(replies, fed, "accuracy_after")
        return {
            "round": int(self.cfg.rounds),
            "phase": "finetune",
            "accuracy_before": client_spread(before.values())["mean"] if before else None,
            "accuracy_after": client_spread(after.values())["mean"] if after else None,
            "accuracy_after_std": client_spread(after.values())["std"] if after else None,
            "accuracy_after_worst10": client_spread(after.values())["worst10"] if after else None,
            "client_accuracy_after": {str(k): v for k, v in sorted(after.items())},
            **failure_fields(failed),
        }

    def new_client_phase(self, fed: Federation) -> dict:
        """Held-out clients adapt a fresh head on the frozen body; mean accuracy per head epoch."""
        body = body_keys(self.model, self.cfg)
        arrays = ArrayRecord({k: self.arrays[k] for k in self.arrays if k in body})
        config = ConfigRecord({"epochs": int(self.cfg.new_clients.epochs), "variant": self.cfg.label})
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        messages = [Message(content, dst_node_id=n, message_type="train.newclient") for n in fed.nodes(self.data.new_clients)]
        replies, failed = self.exchange(messages, fed, "newclient")
        curve = []
        for epoch in range(int(self.cfg.new_clients.epochs) + 1):
            accs = metric_of(replies, fed, f"accuracy_epoch_{epoch}")
            curve.append(client_spread(accs.values())["mean"] if accs else None)
        last = metric_of(replies, fed, f"accuracy_epoch_{int(self.cfg.new_clients.epochs)}")
        log(INFO, "[flrep] new clients (%d): head-only accuracy by epoch %s", len(messages),
            " ".join(_fmt(a) for a in curve))
        return {"round": int(self.cfg.rounds), "phase": "newclients", "newclient_accuracy_by_epoch": curve,
                "client_accuracy": {str(k): v for k, v in sorted(last.items())}, **failure_fields(failed)}

    def ensemble_new_test(self, messages: list[Message], fed: Federation) -> dict:
        """Send ``messages`` (each client returns its own part once), then score the average of
        all returned models' logits (each over the current shared arrays) on the global test set."""
        replies, failed = self.exchange(messages, fed, "newtest")
        idx = torch.as_tensor(self.data.global_test, device=self.evaluator.test.y.device)
        x, y = self.evaluator.test.x[idx], self.evaluator.test.y[idx]
        logits = None
        self.evaluator.load(self.arrays)  # shared part; each reply then replaces the whole own part
        for rep in replies:
            self.evaluator.load(rep.content[ARRAYS])
            out = predict(self.evaluator.model, x).double()
            logits = out if logits is None else logits + out
        record = {"round": int(self.cfg.rounds), "phase": "newtest", "new_test_models": len(replies),
                  **failure_fields(failed)}
        if logits is not None:
            record["new_test_accuracy"] = float((logits.argmax(dim=1) == y).double().mean())
            log(INFO, "[flrep] New Test (logits of %d local models averaged): %s", len(replies),
                _fmt(record["new_test_accuracy"]))
        return record

    def linear_new_clients(self) -> dict:
        """New linear tasks fit a least-squares head on n samples with the learned B (FedRep Fig. 4)."""
        cfg, meta = self.cfg, self.data.bundle.meta
        b = self.arrays.to_torch_state_dict()["body.weight"].double().numpy().T
        errors = new_client_errors(b, meta["B_star"], list(cfg.new_clients.samples), int(cfg.new_clients.tasks),
                                   float(meta["noise"]), float(cfg.data.synthetic.head_scale), int(cfg.seed))
        log(INFO, "[flrep] new linear clients, error |Bw - B*w*|^2 by samples n: %s (local only: %s)",
            {n: f"{e:.3g}" for n, e in errors["head_on_learned_b"].items()},
            {n: f"{e:.3g}" for n, e in errors["local_only"].items()})
        return {"round": int(cfg.rounds), "phase": "newclients", "newclient_error": errors["head_on_learned_b"],
                "newclient_error_local_only": errors["local_only"]}

    def online_phase(self, fed: Federation) -> None:
        """LG-FedAvg Table 3: the online device joins for ``online.rounds`` rounds, each with a
        fraction ``online.fraction`` of the original devices; every evaluated round records
        the accuracy on normal data (mean over the original devices' local tests) and on the
        device's rotated test set."""
        cfg, device = self.cfg, self.data.online_device
        start, rounds = self.last_main_round, int(cfg.online.rounds)
        others = math.ceil(float(cfg.online.fraction) * len(self.trainable) - 1e-9)
        for s in range(max(1, self.next_round - start), rounds + 1):  # a resumed run goes on where it stopped
            t = start + s
            pids = [device] + (sample_clients(self.trainable, others, int(cfg.seed), t) if others else [])
            self.adopt_restarted(t, fed)
            record = self.train_round(t, fed, pids)
            record["phase"] = "online-train"
            self.recorder.log(record)
            if not (s % int(cfg.eval.every) and s <= rounds - int(cfg.eval.final_window) and s != 1):
                self.online_evaluation(t, s, fed)
            self.save_checkpoint(t, fed)

    def online_evaluation(self, t: int, s: int, fed: Federation) -> None:
        """Online round ``s`` (round ``t``): accuracy on normal data and on the device's rotated test set."""
        device, rounds = self.data.online_device, int(self.cfg.online.rounds)
        record = self.evaluate_round(t, fed, self.trainable + [device])
        accs = {int(k): v for k, v in record["client_accuracy"].items()}
        normal = [v for k, v in accs.items() if k != device]
        record.update(phase="online", online_round=s,
                      normal_accuracy=float(np.mean(normal)) if normal else None,
                      rotated_accuracy=accs.get(device), elapsed_s=time.monotonic() - self.start)
        record.update(self.traffic.as_dict())
        self.recorder.log(record)
        self.tracker.log({f"online/{k}": v for k, v in record.items()}, step=t)
        log(INFO, "[flrep] online round %d/%d (round %d) | normal acc %s | rotated acc %s | global acc %s",
            s, rounds, t, _fmt(record["normal_accuracy"]), _fmt(record["rotated_accuracy"]),
            _fmt(record.get("global_accuracy")))

    def should_evaluate(self, t: int) -> bool:
        cfg = self.cfg
        required = getattr(self.strategy, "must_evaluate", None)
        return (t % int(cfg.eval.every) == 0 or t > int(cfg.rounds) - int(cfg.eval.final_window) or t == 1
                or (required is not None and required(t)))

    def adopt_restarted(self, t: int, fed: Federation) -> None:
        """Before round ``t``: hand restarted SuperNodes (new node ids) their clients, restored to round ``t - 1``."""
        if rejoin(self.grid, fed, self.traffic, self.handshake(restore_round=t - 1), self.reply_timeout):
            self.observe_population(fed)

    def observe_population(self, fed: Federation) -> None:
        """Tell the strategy every training client's node and size (hook)."""
        observe = getattr(self.strategy, "observe_population", None)
        if observe is not None:
            observe({fed.node_of[p]: fed.train_size[p] for p in self.trainable})

    # -- main loop ------------------------------------------------------------------------
    def start_federation(self) -> Federation:
        """Connect to the nodes (handshake) and tell the strategy who they are (hooks)."""
        fed = connect(self.grid, self.data.num_clients, self.traffic, float(self.cfg.faults.node_wait_s),
                      self.handshake(self.next_round - 1 if self.resumed is not None else -1), self.reply_timeout)
        if self.resumed is not None:
            checkpoint.restore_node_sets(self.strategy, fed.node_of)
        self.observe_population(fed)
        on_start = getattr(self.strategy, "on_start", None)
        if on_start is not None:
            on_start(self, fed)
        return fed

    def run(self) -> dict:
        cfg = self.cfg
        rounds = int(cfg.rounds)
        log(INFO, "[flrep] %s: %s on %s, %d clients (%d per round), %d rounds -> %s",
            cfg.experiment, cfg.algorithm, cfg.data.name, self.data.num_clients, self.num_sampled, rounds, self.out_dir)
        fed = self.start_federation()
        loop_start, first_round = time.monotonic(), self.next_round
        prepare = getattr(self.strategy, "prepare_round", None)
        for t in range(self.next_round, 0 if self.main_done else rounds + 1):
            self.adopt_restarted(t, fed)
            phase_record = prepare(t, self, fed) if prepare is not None else None
            if phase_record is not None:
                phase_record.update(self.traffic.as_dict(), elapsed_s=time.monotonic() - self.start)
                self.recorder.log(phase_record)
            train_record = self.train_round(t, fed)
            elapsed = time.monotonic() - self.start
            train_record.update(self.traffic.as_dict(), elapsed_s=elapsed)
            self.recorder.log(train_record)
            self.tracker.log({f"train/{k}": v for k, v in train_record.items()}, step=t)
            if self.should_evaluate(t):
                eval_record = self.evaluate_round(t, fed)
                if hasattr(self.strategy, "observe_eval"):
                    self.strategy.observe_eval(t, eval_record)
                eval_record.update(self.traffic.as_dict(), elapsed_s=time.monotonic() - self.start)
                self.recorder.log(eval_record)
                self.tracker.log({f"eval/{k}": v for k, v in eval_record.items()}, step=t)
                eta = (time.monotonic() - loop_start) / (t - first_round + 1) * (rounds - t)
                extra = "".join(f" | {name} {_fmt(eval_record.get(key))}" for key, name in EXTRA_PROGRESS
                                if eval_record.get(key) is not None
                                and (key != "personalized_loss" or eval_record["personalized_accuracy"] is None))
                log(INFO, "[flrep] round %d/%d | personalized acc %s | global acc %s%s | elapsed %.1fs | ETA %.1fs",
                    t, rounds, _fmt(eval_record["personalized_accuracy"]), _fmt(eval_record.get("global_accuracy")),
                    extra, time.monotonic() - self.start, eta)
                goal = cfg.online.start_accuracy
                if goal is not None and (eval_record.get("global_accuracy") or 0.0) >= goal:
                    self.last_main_round, self.main_done = t, True
                    log(INFO, "[flrep] global accuracy reached online.start_accuracy=%s at round %d", goal, t)
            self.main_done = self.main_done or t == rounds
            self.save_checkpoint(t, fed)
            if self.main_done:
                break
        if int(cfg.online.rounds) > 0:
            self.online_phase(fed)
        finetune = None
        if cfg.finetune.enabled:
            finetune = self.finetune_phase(fed)
            finetune.update(self.traffic.as_dict(), elapsed_s=time.monotonic() - self.start)
            self.recorder.log(finetune)
            log(INFO, "[flrep] +FT: personalized acc before %s, after %s fine-tuning",
                _fmt(finetune["accuracy_before"]), _fmt(finetune["accuracy_after"]))
        if self.algorithm.final_phase is not None:
            record = self.algorithm.final_phase(self, fed)
            record.update(self.traffic.as_dict(), elapsed_s=time.monotonic() - self.start)
            self.recorder.log(record)
        if self.evaluator.linear and self.algorithm.shared_keys is not None:
            self.recorder.log(self.linear_new_clients())
        elif self.data.new_clients and self.algorithm.shared_keys is not None:
            record = self.new_client_phase(fed)
            record.update(self.traffic.as_dict(), elapsed_s=time.monotonic() - self.start)
            self.recorder.log(record)
        summary = self.summary(finetune)
        self.recorder.write_summary(summary)
        self.recorder.plot(self.name)
        self.tracker.finish(summary)
        log(INFO, "[flrep] personalized accuracy (final %d rounds) %s, global accuracy %s, %.1fs",
            int(cfg.eval.final_window), _fmt(summary["personalized_accuracy"]), _fmt(summary["global_accuracy"]), summary["wall_time_s"])
        log(INFO, "[flrep] outputs: %s", self.out_dir)
        return summary

    def summary(self, finetune: dict | None) -> dict:
        cfg = self.cfg
        evals = [r for r in self.recorder.records if r["phase"] == "eval"]
        rounds = [r["round"] for r in evals]
        window = int(cfg.eval.final_window)

        def final(key: str) -> float | None:
            return final_window_mean(rounds, [r.get(key) for r in evals], self.last_main_round, window)

        trains = [r for r in self.recorder.records if r["phase"] == "train"]
        summary = {
            "status": "completed",
            "experiment": cfg.experiment,
            "algorithm": cfg.algorithm,
            "dataset": cfg.data.name,
            "model": cfg.model.name,
            "num_clients": self.data.num_clients,
            "clients_per_round": self.num_sampled,
            "rounds": int(cfg.rounds),
            "seed": int(cfg.seed),
            "personalized_accuracy": final("personalized_accuracy"),
            "personalized_accuracy_std": final("personalized_accuracy_std"),
            "personalized_accuracy_worst10": final("personalized_accuracy_worst10"),
            "personalized_loss": final("personalized_loss"),
            "global_accuracy": final("global_accuracy"),
            "global_accuracy_last": evals[-1].get("global_accuracy") if evals else None,
            "final_window": window,
            "failed_client_replies": sum(len(r.get("failed_clients", [])) for r in self.recorder.records),
            "rounds_skipped": [r["round"] for r in trains if r.get("skipped")],
            "wall_time_s": time.monotonic() - self.start,
            "out_dir": str(self.out_dir),
        }
        summary.update(self.traffic.as_dict())
        summary["params_by_phase"] = dict(self.traffic.by_phase)
        if self.evaluator.linear and evals:
            summary["representation_distance"] = evals[-1].get("representation_distance")
            summary["global_grad_norm"] = evals[-1].get("global_grad_norm")
        if not self._has_global_model(int(cfg.rounds)):
            summary["global_accuracy"] = summary["global_accuracy_last"] = None
        online = [r for r in self.recorder.records if r["phase"] == "online"]
        if online:
            last = online[-1]["round"]
            summary["online_start_round"] = self.last_main_round
            summary["online_rounds"] = online[-1]["online_round"]
            for key in ("normal_accuracy", "rotated_accuracy", "global_accuracy"):
                summary[f"online_{key}"] = final_window_mean([r["round"] for r in online], [r.get(key) for r in online],
                                                             last, window)
        if self.fair and evals:
            for key in FAIR_METRICS + ("adversary_auc", "postfit_auc"):
                value = final(key) if not key.startswith("postfit") else evals[-1].get(key)
                if value is not None:
                    summary[key] = value
        if hasattr(self.strategy, "summary_extra"):
            summary.update(self.strategy.summary_extra(self.recorder.records))
        if hasattr(self.strategy, "switch_round"):
            summary["lg_switch_round"] = self.strategy.switch_round
        for record in self.recorder.records:
            if record["phase"] == "newtest":
                summary["new_test_accuracy"] = record.get("new_test_accuracy")
            if record["phase"] == "newclients" and "newclient_accuracy_by_epoch" in record:
                summary["newclient_accuracy"] = record["newclient_accuracy_by_epoch"][-1]
                summary["newclient_accuracy_by_epoch"] = record["newclient_accuracy_by_epoch"]
            if record["phase"] == "newclients" and "newclient_error" in record:
                summary["newclient_error"] = record["newclient_error"]
                summary["newclient_error_local_only"] = record["newclient_error_local_only"]
        if finetune is not None:
            summary["finetune_accuracy_before"] = finetune["accuracy_before"]
            summary["finetune_accuracy_after"] = finetune["accuracy_after"]
            summary["finetune_accuracy_after_std"] = finetune["accuracy_after_std"]
            summary["finetune_accuracy_after_worst10"] = finetune["accuracy_after_worst10"]
        return summary


#: Per-client fairness metrics (client replies) averaged over clients each evaluated round.
FAIR_METRICS = ("class_auc", *(f"{kind}_auc_{a}" for kind in ("adversary", "postfit") for a in ATTRIBUTES))


def fairness_means(replies: list[Message], fed: Federation) -> dict:
    """Mean over clients of each fairness metric, and the adversary / post-fit AUC averaged
    over the protected attributes (clients whose labels hold one class do not report a metric)."""
    out: dict = {}
    for key in FAIR_METRICS:
        values = metric_of(replies, fed, key)
        if values:
            out[key] = float(np.mean(list(values.values())))
    for kind in ("adversary", "postfit"):
        per_attr = [out[f"{kind}_auc_{a}"] for a in ATTRIBUTES if f"{kind}_auc_{a}" in out]
        if per_attr:
            out[f"{kind}_auc"] = float(np.mean(per_attr))
    return out


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def run_variants(grid: Grid, variants: tuple[DictConfig, ...]) -> dict:
    """Run each variant in turn on the same federation; with several, write the comparison."""
    for cfg in variants:  # every variant's config and data errors stop the run before round 1
        validate_with_data(cfg)
    if len(variants) == 1:
        return Experiment(grid, variants[0]).run()
    base = output_dir(variants[0])
    summaries, records = {}, {}
    for cfg in variants:
        cfg = cfg.copy()
        cfg.out_dir = str(base / cfg.label)
        if cfg.resume:  # each variant resumes from its own folder: done, checkpointed, or not started
            done = _completed_variant(base / cfg.label)
            if done is not None:
                log(INFO, "[flrep] %s completed before the interruption: kept", cfg.label)
                summaries[cfg.label], records[cfg.label] = done
                continue
            has_checkpoint = (checkpoint.checkpoint_dir(base / cfg.label) / checkpoint.SERVER_FILE).is_file()
            cfg.resume = str(base / cfg.label) if has_checkpoint else None
        experiment = Experiment(grid, cfg)
        summaries[cfg.label] = experiment.run()
        records[cfg.label] = experiment.recorder.records
    summary = write_comparison(base, summaries, records, f"{variants[0].experiment}: {' vs '.join(summaries)}")
    log(INFO, "[flrep] comparison (%s)\n%s", base / "comparison.md", comparison_table(summaries))
    log(INFO, "[flrep] outputs: %s", base)
    return summary


def _completed_variant(out: Path) -> tuple[dict, list[dict]] | None:
    """(summary, records) of a variant that completed in ``out``, else None."""
    path = out / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    if summary.get("status") != "completed":
        return None
    return summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Load and validate the configuration(s), then run the experiment."""
    rc = context.run_config
    run_variants(grid, variants_from_run_config(str(rc.get("experiment", "quickstart")), str(rc.get("overrides", ""))))
