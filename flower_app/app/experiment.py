"""The round loop of one run: sampling, sending and screening, aggregation, evaluation,
checkpoint/resume and results. It names no algorithm: it calls the strategy's Flower methods
and its declared hooks (:class:`strategies.base.ServerHooks`), and the active paper protocols
(:mod:`protocols`), all through the narrow :class:`flower_app.app.services.RunServices`.
"""

from __future__ import annotations

import time
import uuid
from logging import ERROR, INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from omegaconf import DictConfig

from flower_app.app import checkpoint
from flower_app.run import run_dir
from flower_app.run.console import RoundBar
from flower_app.run.ray_cluster import refuse_unnamed_cluster
from flower_app.run.config import PROJECT_DIR, clients_per_round, server_device, validate_with_data
from flower_app.app.outcome import (command_startup_s, describe_window, diverged, incomplete,
                                      no_better_than_chance, no_final_metric, output_dir, skipped_too_many,
                                      unserved_partitions)
from flower_app.app.federation import Federation, NodeSubset, Traffic, connect, other_metrics, rejoin
from flower_app.results.progress import clock, round_line, terminal_round_line
from flower_app.results.contract import RunRecorder
from flower_app.results.provenance import executed_sources
from flower_app.app.services import RunServices
from flower_app.app.timing import PhaseTimer
from flower_app.results.tracking import Tracker
from protocols import PROTOCOLS
from strategies import ALGORITHMS
from strategies.base import Algorithm, ServerHooks
from strategies.common import NUM_EXAMPLES, VALIDATION_ACCURACY, failure_fields, fmt
from strategies.evaluator import ServerEvaluator
from strategies.services import TRAIN_PHASE
from task.data.sampling import sample_clients
from task.files import WriteFailed
from task.learning.metrics import client_spread, final_window_mean, final_window_rounds

class Experiment:
    """One run: the round loop of the configured algorithm plus the active paper protocols."""

    def __init__(self, grid: Grid, cfg: DictConfig, position: tuple[int, int, int] = (1, 1, 0)) -> None:  # (n, of, rounds after)
        self.grid, self.cfg = grid, cfg
        self.position = position
        self.created = time.monotonic()
        self.start = self.created  # reset when the rounds begin: elapsed times count training and evaluation only
        self.startup_s = 0.0
        self.started_at = time.time()
        self.timer = PhaseTimer()
        self.algorithm: Algorithm = ALGORITHMS[cfg.algorithm]
        with self.timer.phase("start: data and model"):
            self.data, self.model = validate_with_data(cfg)
        held_out = set(self.data.new_clients) | {self.data.online_device}
        self.trainable = [p for p in range(self.data.num_clients) if p not in held_out]
        self.last_main_round = int(cfg.rounds)
        self.main_done = False  # the main training rounds are over (a protocol may end them early)
        self.last_round_run = 0  # the last training round sent out (main phase or a protocol's)
        self.num_sampled = clients_per_round(cfg)
        self.traffic = Traffic()
        self.out_dir = output_dir(cfg)
        self.resumed = checkpoint.load(self.out_dir, cfg) if cfg.resume else None
        if self.resumed is None:
            run_dir.claim(self.out_dir)  # a new run never overwrites another
        self.evaluator = ServerEvaluator(self.data, self.model, server_device(cfg), int(cfg.eval.batch_size))
        self.strategy: ServerHooks = self.algorithm.make_strategy(cfg)
        # every check is done: from here on the run writes to its directory
        self.run_token = self.resumed["run_token"] if self.resumed else uuid.uuid4().hex[:12]
        self.recorder = RunRecorder(self.out_dir, cfg,
                                    checkpoint.saved_records(self.out_dir, self.resumed) if self.resumed else ())
        self.name = f"{cfg.experiment}-{cfg.label}-s{cfg.seed}"
        self.tracker = Tracker(cfg, self.out_dir, self.name)
        self.fed: Federation | None = None
        self.services = RunServices(self)
        self.protocols = [p for p in PROTOCOLS if p.active(self.services)]
        if self.algorithm.shared_keys is None:
            self.arrays = ArrayRecord()
        else:
            state = self.model.state_dict()
            self.arrays = ArrayRecord({k: state[k].detach().clone() for k in self.algorithm.shared_keys(self.model, cfg)})
        self.next_round = 1
        self.elapsed_before = 0.0  # training and evaluation seconds before a resume
        if self.resumed is not None:
            self.restore(self.resumed)

    def restore(self, saved: dict) -> None:
        """Continue from a checkpoint: arrays, traffic, rounds, elapsed time (the strategy's state
        is restored after the handshake, when node ids are known)."""
        self.arrays = ArrayRecord({k: Array(v) for k, v in saved["arrays"].items()})
        self.traffic = Traffic(**saved["traffic"])
        self.last_main_round, self.next_round = saved["last_main_round"], saved["round"] + 1
        self.main_done = saved["main_done"]
        self.last_round_run = saved["round"]
        self.elapsed_before = float(saved["elapsed_s"])
        log(INFO, "[flrep] resuming %s after round %d", self.out_dir, saved["round"])

    def handshake(self, restore_round: int = -1) -> ConfigRecord:
        """What a node hears when it joins: the variant, where clients snapshot their state
        after each round, and the round whose snapshot to restore (-1: none)."""
        return ConfigRecord({"variant": self.cfg.label,
                             "checkpoint-dir": str(checkpoint.checkpoint_dir(self.out_dir) / checkpoint.CLIENT_SNAPSHOTS),
                             "checkpoint-key": f"{self.name}-{self.run_token}", "restore-round": restore_round,
                             "input-shape": [int(d) for d in self.data.bundle.input_shape],
                             "num-classes": int(self.data.bundle.num_classes)})

    def save_checkpoint(self, t: int, fed: Federation) -> None:
        """The server checkpoint at the end of round ``t``."""
        checkpoint.save(self.out_dir, {
            "round": t, "config": checkpoint.plain_config(self.cfg), "arrays": checkpoint.arrays_state(self.arrays),
            "strategy": self.strategy.state_dict(fed.pid_of), "run_token": self.run_token,
            "records_count": len(self.recorder.records),
            "traffic": dict(vars(self.traffic)), "last_main_round": self.last_main_round, "main_done": self.main_done,
            "elapsed_s": time.monotonic() - self.start})

    # -- phases ---------------------------------------------------------------------------
    def train_round(self, t: int, fed: Federation, pids: list[int] | None = None) -> dict:
        self.last_round_run = t
        if pids is None:
            pids = sample_clients(self.trainable, self.num_sampled, int(self.cfg.seed), t)
        config = ConfigRecord({"variant": self.cfg.label})
        messages = list(self.strategy.configure_train(t, self.arrays, config, NodeSubset(self.grid, fed.nodes(pids))))
        replies, failed = self.services.send(messages, "train", self.strategy.reply_template)
        record = {"round": t, "phase": TRAIN_PHASE, "clients": pids, "asked": len(messages), **failure_fields(failed)}
        minimum = min(int(self.cfg.faults.min_replies), len(messages))  # online rounds ask fewer clients
        if len(replies) < minimum:
            log(WARNING, "[flrep] round %d skipped: %d sound replies, faults.min_replies=%d", t, len(replies), minimum)
            record["skipped"] = True
            self.strategy.aggregate_skipped(t, replies)  # state the clients already committed
            return record
        with self.timer.phase("round: aggregate"):
            new_arrays, metrics = self.strategy.aggregate_train(t, replies)
        if new_arrays is not None:
            for key in new_arrays:
                self.arrays[key] = new_arrays[key]
        if metrics is not None:
            record.update({k: float(v) for k, v in metrics.items()})
        return record

    def evaluate_round(self, t: int, fed: Federation, pids: list[int] | None = None) -> dict:
        pids = self.trainable if pids is None else pids
        record: dict = {"round": t, "phase": "eval"}
        # nodes with their own data: the server's copy has none of their test splits to score
        client_idx = {} if fed.own_data else {p: self.data.client_test[p] for p in pids}
        with self.timer.phase("round: server evaluation"):
            scores = self.strategy.evaluate_on_server(t, self.arrays, self.data.global_test, client_idx)
        if scores is not None:  # the strategy scores its own (non-model) arrays, e.g. TCT's stage 2
            record["global_accuracy"], record["global_loss"] = scores["global_accuracy"], scores["global_loss"]
            accs, losses, held, failed = scores["accuracy"], scores["loss"], {}, {}
        else:
            accs, losses, held, failed = self._evaluate_model(t, fed, pids, record)
        if self.data.validating:  # the tuning metric (flrep tune), never the test accuracy
            record["personalized_validation_accuracy"] = float(np.mean(list(held.values()))) if held else None
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

    def _evaluate_model(self, t: int, fed: Federation, pids: list[int],
                        record: dict) -> tuple[dict, dict, dict, dict[int, str]]:
        """Global metrics of the server's model into ``record``; personalized accuracy, loss and
        validation accuracy per client (on the server, or by the clients when the algorithm or a
        protocol needs it), and the failed clients."""
        if self.algorithm.shared_keys is not None and self.strategy.has_global_model(t):
            with self.timer.phase("round: server evaluation"):
                self.evaluator.load(self.arrays)
                record["global_accuracy"], record["global_loss"] = self.evaluator.global_metric()
        on_clients = (self.algorithm.evaluates_on_clients or fed.own_data
                      or any(p.clients_evaluate(self.services) for p in self.protocols))
        replies, failed = [], {}
        if on_clients:
            config = ConfigRecord({"variant": self.cfg.label, "server-round": t})
            for protocol in self.protocols:
                config.update(protocol.evaluate_config(t, self.services))
            messages = list(self.strategy.configure_evaluate(t, self.arrays, config,
                                                             NodeSubset(self.grid, fed.nodes(pids))))
            replies, failed = self.services.send(messages, "evaluate")
            accs, losses = self.services.metric_of(replies, "accuracy"), self.services.metric_of(replies, "loss")
            held = self.services.metric_of(replies, VALIDATION_ACCURACY)
        else:
            with self.timer.phase("round: server evaluation"):
                accs, losses = self.evaluator.per_client(pids)
                held = self.evaluator.per_client_validation(pids)
        for protocol in self.protocols:
            protocol.on_evaluate(t, record, replies, self.services)
        if extra := other_metrics(replies, {"accuracy", "loss", VALIDATION_ACCURACY, NUM_EXAMPLES, *record}):
            record["reply_metrics"] = extra  # a plug-in's own evaluation metrics, averaged over its clients
        return accs, losses, held, failed

    def should_evaluate(self, t: int) -> bool:
        cfg = self.cfg
        last = self.strategy.last_round(int(cfg.rounds))
        return (t % int(cfg.eval.every) == 0 or t > last - int(cfg.eval.final_window) or t == 1
                or self.strategy.must_evaluate(t))

    def adopt_restarted(self, t: int, fed: Federation) -> None:
        """Before round ``t``: hand restarted SuperNodes (new node ids) their clients, restored to round ``t - 1``."""
        before = dict(fed.node_of)
        moved = rejoin(self.grid, fed, self.traffic, self.handshake(restore_round=t - 1), self.services.reply_timeout)
        if moved:
            self.strategy.renumber_nodes({before[p]: fed.node_of[p] for p in moved})
            self.observe_population(fed)

    def observe_population(self, fed: Federation) -> None:
        """Tell the strategy every training client's node and size."""
        self.strategy.observe_population({fed.node_of[p]: fed.train_size[p] for p in self.trainable})

    # -- main loop ------------------------------------------------------------------------
    def start_federation(self) -> Federation:
        """Connect to the nodes (handshake), restore a resumed strategy, tell it who the nodes are."""
        with self.timer.phase("start: handshake"):
            fed = connect(self.grid, self.data.num_clients, self.traffic, float(self.cfg.faults.node_wait_s),
                          self.handshake(self.next_round - 1 if self.resumed is not None else -1),
                          self.services.reply_timeout)
        refuse_unnamed_cluster(self.cfg.simulation.ray_address)  # after the handshake: the engine's Ray is up
        self.fed = fed
        if self.resumed is not None:
            self.strategy.load_state_dict(self.resumed["strategy"], fed.node_of)
        self.observe_population(fed)
        self.strategy.on_start(self.services)
        return fed

    def log_record(self, record: dict, track: str | None = None, stamp: bool = True) -> None:
        """Write ``record`` (with traffic and elapsed time when ``stamp``; to the tracker under ``track``)."""
        if stamp:
            record.update(self.traffic.as_dict(), elapsed_s=time.monotonic() - self.start)
        self.recorder.log(record)
        if track is not None:
            self.tracker.log({f"{track}/{k}": v for k, v in record.items()}, step=record["round"])

    def run(self) -> dict:
        """Train and evaluate, then write the results. A result that cannot be written (a full disk)
        stops the run: its summary, when that can still be written, says failed and names the file."""
        summary = None
        try:
            summary = self.train()
            self.recorder.finish(summary, self.name)
        except WriteFailed as err:
            self.stopped_by(err, summary)
            raise
        self.tracker.finish(summary)
        if summary["status"] != "completed":
            log(ERROR, "[flrep] run %s: %s", summary["status"], summary["failure_reason"])
        log(INFO, "[flrep] personalized accuracy %s, global accuracy %s (%s), %.1fs",
            fmt(summary["personalized_accuracy"]), fmt(summary["global_accuracy"]),
            describe_window(summary["final_window_rounds"]), summary["wall_time_s"])
        log(INFO, "[flrep] outputs: %s", self.out_dir)
        return summary

    def stopped_by(self, err: WriteFailed, summary: dict | None) -> None:
        """Say in the log that ``err`` stopped the run and how to continue it; before its summary was
        made (``summary`` None), also in a short summary, if that can still be written."""
        cfg = self.cfg
        log(ERROR, "[flrep] %s: the run stopped in round %d; make room, then continue it with resume=%s",
            err, self.last_round_run, self.out_dir)
        if summary is not None:  # the recorder wrote it as failed, naming the file
            return
        try:
            self.recorder.write_summary({
                "status": "failed", "failure_reason": str(err), "experiment": cfg.experiment,
                "algorithm": cfg.algorithm, "dataset": cfg.data.name, "rounds": int(cfg.rounds),
                "seed": int(cfg.seed), "out_dir": str(self.out_dir)})
        except WriteFailed as again:
            log(ERROR, "[flrep] no summary was written either: %s", again)

    def train(self) -> dict:
        """The round loop and the protocols' phases after it; the run's summary."""
        cfg = self.cfg
        rounds = int(cfg.rounds)
        log(INFO, "[flrep] %s: %s on %s, %d clients (%d per round), %d rounds -> %s",
            cfg.experiment, cfg.algorithm, cfg.data.name, self.data.num_clients, self.num_sampled, rounds, self.out_dir)
        fed = self.start_federation()
        self.recorder.write_partition(None if fed.own_data else self.data, self.name)
        loop_start, first_round = time.monotonic(), self.next_round
        self.startup_s = loop_start - self.created + command_startup_s(self.started_at)
        self.start = loop_start - self.elapsed_before
        log(INFO, "[flrep] start-up %.1fs (%s); training starts", self.startup_s, ", ".join(
            f"{name.removeprefix('start: ')} {v['s']:.1f}s" for name, v in self.timer.as_dict().items()
            if name.startswith("start:")))
        number, variants, later_rounds = self.position  # the bar comes after the line above (a line under it joins it)
        bar = RoundBar(rounds, first_round - 1, f"{cfg.label} ({number}/{variants})" if variants > 1 else "")
        for t in range(self.next_round, 0 if self.main_done else rounds + 1):
            self.adopt_restarted(t, fed)
            with self.timer.phase("round: prepare"):
                phase_record = self.strategy.prepare_round(t, self.services)
            if phase_record is not None:
                self.log_record(phase_record)
            train_record = self.train_round(t, fed)
            self.log_record(train_record, track="train")
            eval_record = None
            if self.should_evaluate(t):
                eval_record = self.evaluate_round(t, fed)
                self.strategy.observe_eval(t, eval_record, self.services)
                self.log_record(eval_record, track="eval")
                if any(p.ends_main_phase(eval_record, self.services) for p in self.protocols):
                    self.last_main_round, self.main_done = t, True
            last = self.strategy.last_round(rounds)
            per_round = (time.monotonic() - loop_start) / (t - first_round + 1)
            run_eta = f"run ETA {clock(per_round * (last - t + later_rounds))}" if variants > 1 else ""
            whole = f"variant {number}/{variants}, {run_eta}" if run_eta else ""
            bar.advance(round_line(t, last, train_record, eval_record, time.monotonic() - self.start, per_round, whole),
                        terminal_round_line(t, last, train_record, eval_record, time.monotonic() - self.start,
                                            per_round * (last - t)), run_eta)
            if not self.main_done and (t >= last or self.already_failed(rounds)):
                self.last_main_round, self.main_done = t, True
            with self.timer.phase("round: checkpoint"):
                self.save_checkpoint(t, fed)
            if self.main_done:
                break
        bar.close()
        for protocol in self.protocols:
            protocol.after_main(self.services)
        for protocol in self.protocols:
            with self.timer.phase(f"after training: {protocol.name}"):
                record = protocol.after_training(self.services)
            if record is not None:
                self.log_record(record)
        return self.summary()

    def summary(self) -> dict:
        cfg, records = self.cfg, self.recorder.records
        evals = [r for r in records if r["phase"] == "eval"]
        window = int(cfg.eval.final_window)

        def final(key: str) -> float | None:
            return final_window_mean([r["round"] for r in evals], [r.get(key) for r in evals], self.last_main_round,
                                     window)

        headline = next((k for k in ("personalized_accuracy", "personalized_loss", "global_accuracy")
                         if any(r.get(k) is not None for r in evals)), "personalized_accuracy")

        trains = [r for r in records if r["phase"] == TRAIN_PHASE]
        summary = {
            "status": "completed", "experiment": cfg.experiment, "algorithm": cfg.algorithm,
            "dataset": cfg.data.name, "model": cfg.model.name, "num_clients": self.data.num_clients,
            "clients_per_round": self.num_sampled, "rounds": int(cfg.rounds), "seed": int(cfg.seed),
            **({"smoke": True} if cfg.smoke else {}),  # a first look: its numbers say only that it runs
            **{key: final(key) for key in ("personalized_accuracy", "personalized_accuracy_std",
                                           "personalized_accuracy_worst10", "personalized_loss", "global_accuracy")},
            "global_accuracy_last": evals[-1].get("global_accuracy") if evals else None,
            "global_accuracy_best": max((r["global_accuracy"] for r in evals if r.get("global_accuracy") is not None),
                                        default=None),
            "final_window": window,
            "final_window_rounds": final_window_rounds([r["round"] for r in evals], [r.get(headline) for r in evals],
                                                       self.last_main_round, window),
            "failed_client_replies": sum(len(r.get("failed_clients", [])) for r in records),
            "unserved_partitions": unserved_partitions(records),
            "rounds_skipped": [r["round"] for r in trains if r.get("skipped")],
            "wall_time_s": time.monotonic() - self.start, "startup_s": self.startup_s,
            "wall_time_per_round_s": (time.monotonic() - self.start) / max(len(trains), 1),
            "total_time_s": time.monotonic() - self.start + self.startup_s,
            "started_at": self.started_at,
            "timings": self.timer.as_dict(),
            "out_dir": str(self.out_dir),
        }
        if self.data.validating:
            summary["validation_fraction"] = float(cfg.data.validation_fraction)
            summary["validation_accuracy"] = final("personalized_validation_accuracy")
        summary.update(self.traffic.as_dict())
        summary["params_by_phase"] = dict(self.traffic.by_phase)
        summary["source"] = executed_sources(PROJECT_DIR)
        if not self.strategy.has_global_model(self.last_main_round):
            summary["global_accuracy"] = summary["global_accuracy_last"] = summary["global_accuracy_best"] = None
        for protocol in self.protocols:
            summary.update(protocol.summary(records, self.services))
        summary.update(self.strategy.summary_extra(records))
        judged = not (self.fed is not None and self.fed.own_data) and not cfg.smoke  # labels here; no smoke run
        reason = (skipped_too_many(trains, float(cfg.faults.max_skipped_fraction))
                  or self.strategy.run_failure(self.last_round_run)
                  or no_final_metric(summary, final("global_loss"), window)
                  or diverged(records, None if self.data.bundle.task == "regression" else int(self.data.bundle.num_classes))
                  or (no_better_than_chance(summary, self.data, self.trainable) if judged else None)
                  or (next(filter(None, (p.run_failure(summary, self.services) for p in self.protocols)), None)
                      if not cfg.smoke else None))
        if reason is not None:
            summary.update(status="failed", failure_reason=reason)
        elif not cfg.faults.allow_unserved and (gaps := incomplete(summary["unserved_partitions"])):
            summary.update(status="incomplete", failure_reason=gaps)
        return summary

    def already_failed(self, rounds: int) -> bool:
        """Whether more training rounds were skipped than ``faults.max_skipped_fraction`` allows
        of the whole run: it has failed whatever follows (a diverged model's every reply is
        rejected), so it stops now instead of skipping its remaining rounds (logged)."""
        skipped = sum(1 for r in self.recorder.records if r["phase"] == TRAIN_PHASE and r.get("skipped"))
        limit = float(self.cfg.faults.max_skipped_fraction)
        if skipped <= limit * rounds:
            return False
        log(ERROR, "[flrep] %d of the run's %d training rounds were skipped, more than faults.max_skipped_fraction="
            "%g allows: the run has failed; stopping now", skipped, rounds, limit)
        return True
